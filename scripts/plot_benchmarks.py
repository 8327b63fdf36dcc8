#!/usr/bin/env python3
"""Draw the manual's benchmark plots from the numbers they came from.

    .venv/bin/python scripts/plot_benchmarks.py            # docs/performance/img/*.svg
    .venv/bin/python scripts/plot_benchmarks.py --check    # exit 1 naming each stale plot

Input: docs/performance/data/*.json (one file per benchmark script: the command, the machine,
the columns and rows it printed; docs/performance/index.md has the same numbers as tables).
A benchmark script that measures again rewrites its JSON and calls ``draw()`` (or this
script), and both are committed together.

Invariants: a plot is a pure function of its JSON file (SVG with text kept as text, no date,
fixed hash salt), so ``--check`` can compare byte for byte; every JSON file under data/ is
drawn by exactly one function below (a file without one stops the script, naming it).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs/performance/data"
IMG = ROOT / "docs/performance/img"
RAW, CKPTD, OTHER, GREY = "#7f7f7f", "#1f77b4", "#ff7f0e", "#c7c7c7"


def setup() -> None:
    """The same rendering on every machine: bundled DejaVu, text as text, fixed salt."""
    plt.rcdefaults()
    plt.rcParams.update({
        "svg.fonttype": "none", "svg.hashsalt": "ckptd-docs", "font.family": "DejaVu Sans",
        "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
        "figure.dpi": 100,
    })


def svg(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight",
                metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return buf.getvalue()


def _rows(data: dict[str, Any], key: str | None = None) -> list[dict[str, Any]]:
    table = data if key is None else data[key]
    return [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]


def _bars(ax: Any, labels: list[str], series: list[tuple[str, list[float], str, str]],
          unit: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values, color, hatch) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name, color=color, hatch=hatch,
                      edgecolor="white" if not hatch else "black", linewidth=0.5)
        ax.bar_label(bars, fmt="%.2f" if max(values) < 20 else "%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(unit)


def _other(data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The run's second daemon (``--also``): its label and rows."""
    if "staged" in data:
        return "ckptd, stream_pages = false", _rows(data, "staged")
    key = next(k for k in data if k.startswith("also "))
    return "ckptd, " + key.removeprefix("also ").replace("=", " = "), _rows(data, key)


def speed(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    other_name, other = _other(data)
    labels = [f"{r['size_gib']} GiB {r['kind']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    _bars(axes[0], labels, [
        ("raw criu dump", [r["raw_dump"] for r in rows], RAW, ""),
        ("raw criu dump + sync", [r["raw_dump_sync"] for r in rows], GREY, ""),
        ("ckptd (streamed, default)", [r["ckptd_dump"] for r in rows], CKPTD, ""),
        (other_name, [r["dump"] for r in other], OTHER, ""),
    ], "seconds")
    axes[0].set_title("dump: until durable")
    _bars(axes[1], labels, [
        ("raw criu", [r["raw_frozen"] for r in rows], RAW, ""),
        ("ckptd (streamed)", [r["ckptd_frozen"] for r in rows], CKPTD, ""),
        (other_name, [r["frozen"] for r in other], OTHER, ""),
    ], "seconds")
    axes[1].set_title("frozen: the job stopped")
    _bars(axes[2], labels, [
        ("raw criu restore", [r["raw_restore"] for r in rows], RAW, ""),
        ("ckptd (streamed restore)", [r["ckptd_restore"] for r in rows], CKPTD, ""),
        (other_name, [r["restore"] for r in other], OTHER, ""),
    ], "seconds")
    axes[2].set_title("restore: until the process runs")
    for ax in axes:
        ax.legend(fontsize=7, frameon=False, loc="upper left")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Checkpoint and restore against raw CRIU (bench_speed.py; 2 vCPUs)")
    return fig


def memory(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    other_name, other = _other(data)
    labels = [f"{r['size_gib']} GiB {r['kind']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    _bars(ax, labels, [
        ("ckptd (streamed, default: the spill in RAM)",
         [r["peak_rss_dump_mib"] + r["staging_dump_mib"] for r in rows], CKPTD, ""),
        (other_name,
         [r["peak_rss_dump_mib"] + r["staging_dump_mib"] for r in other], OTHER, ""),
    ], "MiB")
    ax.axhline(512, color="black", linewidth=0.8, linestyle="--")
    ax.text(-0.45, 540, "target: 512 MiB", fontsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title("A dump's peak extra memory: daemon RSS growth + staging")
    return fig


def store(data: dict[str, Any]) -> Figure:
    rows = {r["step"]: r for r in _rows(data)}
    mib = 1 << 20
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["(a) raw criu dump", "(b) (a) + zstd -1 -T0", "(c) ckptd full",
             "(d) ckptd after 5% rewrite"]
    short = ["raw images", "zstd -1 of them", "ckptd: first\ncheckpoint",
             "ckptd: next, after\n5% rewritten"]
    colors = [RAW, GREY, CKPTD, CKPTD]
    bars = axes[0].bar(short, [rows[n]["bytes"] / mib for n in names], color=colors)
    axes[0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0].set_ylabel("MiB")
    axes[0].set_title("bytes written to the store")
    times = ["(a) raw criu dump", "(c) ckptd full", "(d) ckptd after 5% rewrite",
             "(e) raw criu restore", "(e) ckptctl restore (ckptd)"]
    tshort = ["raw dump", "ckptd dump", "ckptd dump\n(5% changed)", "raw restore",
              "ckptctl restore"]
    tbars = axes[1].bar(tshort, [rows[n]["time"] for n in times],
                        color=[RAW, CKPTD, CKPTD, RAW, CKPTD])
    axes[1].bar_label(tbars, fmt="%.2f", fontsize=7)
    axes[1].set_ylabel("seconds")
    axes[1].set_title("time")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("The store: 1 GiB bigmem, full and incremental checkpoints (bench_store.py)")
    return fig


def gc(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = [r["gc"] for r in rows]
    _bars(ax, labels, [
        ("packs before gc", [r["packs_before_mib"] for r in rows], GREY, ""),
        ("packs after gc", [r["packs_after_mib"] for r in rows], CKPTD, ""),
    ], "MiB")
    unique = rows[0]["unique_stored_mib"]
    ax.axhline(unique, color="black", linewidth=0.8, linestyle="--")
    ax.text(-0.45, unique + 15, f"what the 3 kept checkpoints need: {unique} MiB", fontsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_title("Store size after 30 periodic checkpoints (keep 3) and one gc (bench_gc.py)")
    return fig


def migrate(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    moves = sorted({r["migration"] for r in rows}, key=[r["migration"] for r in rows].index)

    def pick(path: str, column: str) -> list[float]:
        return [next(r[column] for r in rows if r["migration"] == m and r["path"] == path)
                for m in moves]

    raw, ours = "raw criu + zstd -1 -T0", "ckptctl migrate"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    _bars(axes[0], moves, [("criu dump | zstd | restore, by hand", pick(raw, "downtime"), RAW, ""),
                           ("ckptctl migrate", pick(ours, "downtime"), CKPTD, "")], "seconds")
    axes[0].set_title("downtime: frozen until it runs on the target")
    mib = 1 << 20
    _bars(axes[1], moves, [("by hand", [b / mib for b in pick(raw, "bytes_sent")], RAW, ""),
                           ("ckptctl migrate", [b / mib for b in pick(ours, "bytes_sent")],
                            CKPTD, "")], "MiB sent")
    axes[1].set_yscale("log")
    axes[1].set_title("bytes sent (log scale)")
    for ax in axes:
        ax.legend(fontsize=7, frameon=False, loc="upper right")
    fig.suptitle("Migrating a 1 GiB job there and back (bench_migrate.py)")
    return fig


def lazy(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    labels = [f"{r['size_gib']:g} GiB {r['kind']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    _bars(ax, labels, [
        ("criu restore", [r["raw_eager"] for r in rows], GREY, ""),
        ("ckptctl restore", [r["ckptd_eager"] for r in rows], OTHER, ""),
        ("criu restore --lazy-pages", [r["raw_lazy"] for r in rows], RAW, ""),
        ("ckptctl restore --lazy", [r["ckptd_lazy"] for r in rows], CKPTD, ""),
    ], "seconds until the job runs")
    ax.axhline(0.2, color="black", linewidth=0.8, linestyle="--")
    ax.text(-0.45, 0.25, "target at 4 GiB: 0.2 s", fontsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title("Lazy restore: time until the job runs (bench lazy)")
    return fig


def daemon(data: dict[str, Any]) -> Figure:
    rows = _rows(data)
    labels = [r["path"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    _bars(ax, labels, [("ckptctl dump", [r["dump"] for r in rows], CKPTD, ""),
                       ("ckptctl restore", [r["restore"] for r in rows], OTHER, "")],
          "seconds")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title("1 GiB of random pages: the daemon against CRIU alone (bench_daemon.py)")
    return fig


PLOTS: dict[str, dict[str, Callable[[dict[str, Any]], Figure]]] = {
    "speed.json": {"speed.svg": speed, "memory.svg": memory},
    "store.json": {"store.svg": store},
    "gc.json": {"gc.svg": gc},
    "migrate.json": {"migrate.svg": migrate},
    "daemon.json": {"daemon.svg": daemon},
    "lazy.json": {"lazy.svg": lazy},
}


def draw() -> dict[Path, bytes]:
    """Every plot, by path, from every data file (SystemExit naming one without a plot)."""
    unplotted = sorted(p.name for p in DATA.glob("*.json") if p.name not in PLOTS)
    if unplotted:
        raise SystemExit(f"plot_benchmarks: no plot for {', '.join(unplotted)}: add one to "
                         "PLOTS in scripts/plot_benchmarks.py")
    setup()
    out = {}
    for name, plots in PLOTS.items():
        data = json.loads((DATA / name).read_text())
        for image, plot in plots.items():
            out[IMG / image] = svg(plot(data))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming each plot that is not current")
    args = ap.parse_args(argv)
    return write_or_check(draw(), check=args.check, script="plot_benchmarks.py")


def write_or_check(images: dict[Path, bytes], *, check: bool, script: str) -> int:
    """Write ``images`` (path -> content); with ``check``, write nothing and name each one
    that differs from what is on disk (exit status 1). Shared with draw_sequences.py."""
    if check:
        stale = [p for p, content in images.items()
                 if not p.is_file() or p.read_bytes() != content]
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run .venv/bin/python "
                  f"scripts/{script} and commit it", file=sys.stderr)
        return 1 if stale else 0
    for p, content in images.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
