"""Ordered steps with rollback: the shape of every multi-step operation in ckptd.

Invariants:
- steps run in order; each reports progress before it starts;
- if a step raises, the undo of that step (it may have half-happened, so every undo must
  tolerate a partial ``do``) and then of every earlier step run, in reverse order;
- an undo that fails is logged and recorded as a note on the original error; it never hides
  the original error and never stops the remaining undos;
- the original exception propagates unchanged (its type, message and cause).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ckptd.domain import Progress

log = logging.getLogger(__name__)

Ctx = TypeVar("Ctx")
ProgressSink = Callable[[Progress], None]


def no_progress(_: Progress) -> None:
    """A progress sink that drops everything."""


@dataclass(frozen=True)
class Step(Generic[Ctx]):
    name: str
    do: Callable[[Ctx], None]
    undo: Callable[[Ctx], None] | None = None
    describe: str = ""


def run_steps(steps: Sequence[Step[Ctx]], ctx: Ctx, progress: ProgressSink = no_progress) -> None:
    """Run ``steps`` over ``ctx``; on failure undo what was started, newest first."""
    started: list[Step[Ctx]] = []
    total = len(steps)
    for index, step in enumerate(steps):
        progress(Progress(step.name, step.describe or step.name, index / total))
        started.append(step)
        try:
            step.do(ctx)
        except BaseException as exc:
            _rollback(started, ctx, exc)
            raise
    progress(Progress("done", "done", 1.0))


def _rollback(started: list[Step[Ctx]], ctx: Ctx, exc: BaseException) -> None:
    for step in reversed(started):
        if step.undo is None:
            continue
        try:
            step.undo(ctx)
        except Exception as undo_exc:
            log.exception("rollback of step %r failed", step.name)
            exc.add_note(f"rollback of step {step.name!r} also failed: {undo_exc}")
