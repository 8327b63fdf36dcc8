"""The benchmarks' one tool (bench/, ADR 0023): every subcommand parses its options, every
``scripts/bench_*.py`` entry point still answers, and a report's JSON has the shape
scripts/plot_benchmarks.py reads (docs/performance/data/*.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cli import COMMANDS, build_parser  # noqa: E402
from bench.report import Col, Report  # noqa: E402

OPTIONS = {
    "daemon": ["--mib", "8", "--repeat", "1", "--criu", "/a", "--criu", "/b", "--stream",
               "--restore-stream", "--baseline", "/tmp/before", "--dir", "/tmp/w"],
    "files": ["--mib", "8", "--dir", "/tmp/w"],
    "gc": ["--mib", "8", "--dumps", "2", "--keep", "1", "--rewrite-pct", "5",
           "--steps-between", "1", "--dir", "/tmp/w", "--no-compact"],
    "lazy": ["--sizes", "64,128", "--kinds", "random", "--dir", "/tmp/w"],
    "meta": ["--mib", "8", "--mode", "staged", "--known", "--parent"],
    "migrate": ["--mib", "8", "--pause", "0.5"],
    "no-io-uring": ["--calls", "10", "--rounds", "1"],
    "pages": ["--mib", "8", "--repeat", "1", "--dir", "/tmp/w", "--compare-with", "/tmp/b"],
    "rss": ["--dumps", "2", "--every", "1", "--mem-mib", "1", "--dir", "/tmp/w",
            "--env", "MALLOC_ARENA_MAX=2"],
    "speed": ["--sizes", "64,128", "--kinds", "mixed", "--dir", "/tmp/w",
              "--also", "stream_pages=false", "--small", "3"],
    "store": ["--gib", "0.1", "--dir", "/tmp/w", "--baseline", "/tmp/b", "--baseline-last"],
    "stream": ["--mib", "8", "--rounds", "1", "--ways", "ps-null", "--sink-only"],
}


def test_every_subcommand_is_listed_here() -> None:
    assert set(OPTIONS) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_subcommand_parses_its_options(name: str) -> None:
    parser = build_parser()
    args = parser.parse_args([name, *OPTIONS[name], "--json", "/tmp/out.json"])
    assert args.command == name and args.json == Path("/tmp/out.json")
    # every option given was taken, none left at its default
    defaults = parser.parse_args([name])
    given = {a.lstrip("-").replace("-", "_") for a in OPTIONS[name] if a.startswith("--")}
    assert all(getattr(args, g) != getattr(defaults, g) for g in given), given
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--no-such-option"])


def test_speed_keeps_its_options_and_defaults() -> None:
    args = build_parser("speed").parse_args(["speed"])
    assert (args.sizes, args.kinds, args.dir, args.also, args.small) == (
        "1024,4096", "mixed,random", "", [], 0)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_script_entry_point_answers(name: str) -> None:
    script = ROOT / "scripts" / f"bench_{name.replace('-', '_')}.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout


def test_a_report_is_markdown_and_plot_json(tmp_path: Path) -> None:
    report = Report("demo", "python -m bench demo")
    report.units = {"time": "s"}
    main = report.table("demo", [Col("path"), Col("dump", "dump (s)", "{:.3f}"),
                                 Col("bytes", fmt="{:,}")])
    main.add("raw", 0.55123456, 1234567)
    main.add("ckptd", 0.75, None)
    other = report.table("second", ["k", "v"], note="the other table")
    other.add("a", 1)
    assert main.markdown().splitlines() == [
        "| path | dump (s) | bytes |", "|---|---:|---:|",
        "| raw | 0.551 | 1,234,567 |", "| ckptd | 0.750 | - |"]
    report.write(tmp_path / "demo.json")
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["benchmark"] == "demo" and data["units"] == {"time": "s"}
    # as plot_benchmarks._rows reads a table: columns zipped with each row
    rows = [dict(zip(data["columns"], r, strict=True)) for r in data["rows"]]
    assert rows == [{"path": "raw", "dump": 0.5512, "bytes": 1234567},
                    {"path": "ckptd", "dump": 0.75, "bytes": None}]
    assert data["second"] == {"columns": ["k", "v"], "rows": [["a", 1]],
                              "note": "the other table"}
    with pytest.raises(ValueError, match="table demo: a row of 1 cells for 3 columns"):
        main.add("short")


def test_the_small_job_s_figure_says_what_it_was_measured_under(tmp_path: Path) -> None:
    from bench.speed import conditions

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nDirty:            204800 kB\n")
    said = conditions("after the sizes above", meminfo)
    assert said.startswith("after the sizes above, load average ")
    assert said.endswith(", 200 MiB dirty awaiting writeback")
    assert conditions("first", tmp_path / "none").endswith(" 0 MiB dirty awaiting writeback")
