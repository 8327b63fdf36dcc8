"""``python -m bench SUBCOMMAND [options] [--json PATH]``: every benchmark as a subcommand.

A subcommand is a module of this package with ``configure(parser)``, which adds its options,
and ``run(args, report) -> int``, which measures, shows its tables through ``report`` and
returns the exit status. ``--json PATH`` (every subcommand) writes the report's JSON there
once the run ends (docs/performance/data/NAME.json is where the manual's plots read it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from bench.report import Report

COMMANDS = {
    "daemon": "what the daemon adds over running CRIU directly",
    "files": "what capturing the files a job writes costs",
    "gc": "GC compaction of a job that rewrites scattered memory",
    "lazy": "lazy restore: time until the job runs, against raw CRIU lazy-pages",
    "meta": "per-page metadata of a dump (peak RSS growth)",
    "migrate": "migration between two daemons against raw CRIU",
    "no-io-uring": "the cost of ckptctl run's io_uring filter",
    "pages": "the store's data path alone (no CRIU, no daemon)",
    "rss": "the daemon's memory over many dumps",
    "speed": "ckptd against raw CRIU, side by side (issue 13's targets)",
    "store": "the checkpoint store against raw CRIU and zstd",
    "stream": "ways for a dump's pages to reach ckptd",
}
"""Subcommand -> what it measures; the module is ``bench.<name with _ for ->``."""


class Benchmark(Protocol):
    __doc__: str | None

    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace, report: Report) -> int: ...


def module_of(name: str) -> Benchmark:
    module: Benchmark = importlib.import_module(f"bench.{name.replace('-', '_')}")
    return module


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, each with its options; with ``only``, that one's options alone (the
    others' modules are not imported: a benchmark run with another tree's ckptd on the path,
    ``pages --round``, imports no module that tree may lack)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, summary in COMMANDS.items():
        if only is not None and name != only:
            commands.add_parser(name, help=summary)
            continue
        module = module_of(name)
        sub = commands.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(sub)
        sub.add_argument("--json", type=Path, default=None, metavar="PATH",
                         help="also write the result as JSON here "
                              "(docs/performance/data/*.json's shape)")
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "") -> int:
    """Run one subcommand (``argv``: the subcommand, then its options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    command = prog or f"python -m bench {' '.join(argv)}"
    report = Report(args.command, command)
    status = module_of(args.command).run(args, report)
    if args.json is not None:
        report.write(args.json)
    return status


def entry(name: str) -> int:
    """``scripts/bench_NAME.py [options]``: the subcommand ``name`` with the script's
    arguments, the script's own command line said in the result."""
    command = " ".join([f"scripts/bench_{name.replace('-', '_')}.py", *sys.argv[1:]])
    return main([name, *sys.argv[1:]], prog=command)
