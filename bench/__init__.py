"""ckptd's benchmarks as one tool: ``python -m bench SUBCOMMAND [options]``.

Each benchmark is a module here with ``configure(parser)`` (its options) and
``run(args, report)`` (the measurement); ``bench.cli`` makes them subcommands. What they share
is in ``bench.common`` (raw CRIU, the workloads, timed commands, processes) and
``bench.report`` (one result format: Markdown tables on stdout, the same tables as JSON with
``--json PATH``, the shape docs/performance/data/*.json has and scripts/plot_benchmarks.py
reads). ``scripts/bench_NAME.py`` stays a thin entry point: ``bench NAME``.

These are scripts a person runs (root, CRIU, minutes of machine time), not timed tests.
"""
