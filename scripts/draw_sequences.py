#!/usr/bin/env python3
"""Draw the dump and restore sequences from the recipes themselves.

    .venv/bin/python scripts/draw_sequences.py            # docs/design/img/*-sequence.svg
    .venv/bin/python scripts/draw_sequences.py --check    # exit 1 naming each stale diagram

The steps are read from the ``Step(...)`` list of ``ckptd/core/dump.py`` and
``ckptd/core/restore.py`` (name and description; each step's undo stays in the recipe, where
it is written), in their order, so a step added, removed, renamed, redescribed or reordered
there changes the diagram, and
``--check`` (run by tests/docs) fails until it is redrawn. Invariant: every step is drawn
against the participant ``ACTOR`` names for it; a step without one stops the script, naming it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import plot_benchmarks as pb
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs/design/img"
PARTICIPANTS = ("ckptctl", "ckptd", "process tree", "journal, staging", "NVIDIA driver",
                "CRIU", "store")
ACTOR = {
    "dump": {"inspect": "process tree", "journal": "journal, staging",
             "stage": "journal, staging", "precopy": "store", "gpu-lock": "NVIDIA driver",
             "gpu-checkpoint": "NVIDIA driver", "criu-dump": "CRIU", "files": "store",
             "let-go": "CRIU", "gate": "ckptd", "commit": "store",
             "gpu-resume": "NVIDIA driver", "criu-finish": "CRIU", "release": "process tree"},
    "restore": {"resolve": "store", "compat": "ckptd", "pids": "process tree",
                "cgroup": "ckptd", "checkout": "store", "stdio": "journal, staging",
                "files": "process tree", "paths": "process tree", "criu-restore": "CRIU",
                "gate": "ckptd",
                "gpu-restore": "NVIDIA driver"},
}
RPC = {"dump": ("Dump(pid)", "Checkpoint (after progress events)"),
       "restore": ("Restore(id | pid | name)", "RestoreResult: the new root pid")}
HELD = {"dump": ("criu-dump", "criu-finish", "frozen: held by CRIU until committed"),
        "restore": ("criu-restore", "gpu-restore", "created stopped; runs after the last step")}


@dataclass(frozen=True)
class StepInfo:
    name: str
    describe: str
    undo: str
    journaled: bool


def steps(recipe: str) -> list[StepInfo]:
    """The recipe's steps in order, read from ckptd/core/<recipe>.py."""
    tree = ast.parse((ROOT / f"ckptd/core/{recipe}.py").read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Step":
            args = node.args
            name = ast.literal_eval(args[0])
            undo = args[2] if len(args) > 2 else None
            describe = ast.literal_eval(args[3]) if len(args) > 3 else ""
            out.append(StepInfo(
                name=name, describe=describe,
                undo="" if undo is None or (isinstance(undo, ast.Constant)
                                            and undo.value is None)
                else getattr(undo, "attr", "").lstrip("_"),
                journaled=any(k.arg == "durable" for k in node.keywords)))
    return out


def diagram(recipe: str) -> Figure:
    import matplotlib.pyplot as plt

    info = steps(recipe)
    actors = ACTOR[recipe]
    missing = [s.name for s in info if s.name not in actors]
    if missing:
        raise SystemExit(f"draw_sequences: no participant for {recipe} step(s) "
                         f"{', '.join(missing)}: add them to ACTOR in scripts/draw_sequences.py")
    rows = len(info) + 2
    fig, ax = plt.subplots(figsize=(12, 0.42 * rows + 1.2))
    xs = {p: i * 1.6 for i, p in enumerate(PARTICIPANTS)}
    top, bottom = 0.0, -(rows + 0.5)
    for p, x in xs.items():
        ax.plot([x, x], [top, bottom], color=pb.GREY, linewidth=1, zorder=0)
        ax.text(x, top + 0.35, p, ha="center", va="bottom", fontsize=8, weight="bold",
                bbox={"boxstyle": "round", "facecolor": "#eef3fa", "edgecolor": pb.CKPTD})
    call, result = RPC[recipe]

    def arrow(y: float, a: str, b: str, label: str, dashed: bool = False) -> None:
        ax.annotate("", xy=(xs[b], y), xytext=(xs[a], y),
                    arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8,
                                "linestyle": "--" if dashed else "-"})
        ax.text(min(xs[a], xs[b]) + 0.08, y + 0.08, label, fontsize=7, va="bottom")

    arrow(-0.5, "ckptctl", "ckptd", call)
    ys = {}
    for i, s in enumerate(info, start=1):
        y = -0.5 - i
        ys[s.name] = y
        label = f"{i}. {s.name}: {s.describe}"
        target = actors[s.name]
        if target == "ckptd":
            ax.plot([xs["ckptd"], xs["ckptd"] + 0.25, xs["ckptd"] + 0.25, xs["ckptd"]],
                    [y + 0.12, y + 0.12, y - 0.12, y - 0.12], color="black", linewidth=0.8)
            ax.text(xs["ckptd"] + 0.32, y, label, fontsize=7, va="center")
        else:
            arrow(y, "ckptd", target, label)
    arrow(-0.5 - (len(info) + 1), "ckptd", "ckptctl", result, dashed=True)
    start, end, text = HELD[recipe]
    x = xs["process tree"]
    ax.add_patch(plt.Rectangle((x - 0.06, ys[end] - 0.2), 0.12, ys[start] - ys[end] + 0.4,
                               color=pb.OTHER, alpha=0.6, zorder=1))
    ax.text(x - 0.12, (ys[start] + ys[end]) / 2, text, fontsize=6.5, rotation=90,
            ha="right", va="center", color="#a04000")
    ax.text(xs["ckptctl"], bottom - 0.2,
            f"ckptd/core/{recipe}.py: each step runs in this order; a failure undoes the "
            "started steps newest first (each step's undo is written beside it there); an "
            "undo journaled first is also replayed by the next start after a crash",
            fontsize=6.5, va="top", color="#555555")
    ax.set_xlim(-0.8, xs["store"] + 0.8)
    ax.set_ylim(bottom - 0.6, top + 1.0)
    ax.axis("off")
    return fig


def draw() -> dict[Path, bytes]:
    pb.setup()
    return {IMG / f"{recipe}-sequence.svg": pb.svg(diagram(recipe)) for recipe in ACTOR}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming each diagram that is not current")
    args = ap.parse_args(argv)
    return pb.write_or_check(draw(), check=args.check, script="draw_sequences.py")


if __name__ == "__main__":
    sys.exit(main())
