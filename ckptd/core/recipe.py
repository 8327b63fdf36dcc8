"""Ordered steps with rollback: the shape of every multi-step operation in ckptd.

Invariants:
- steps run in order; each reports progress before it starts;
- a step with ``durable`` has the typed record of its undo (``core.undo``) written to the
  operation's ``UndoLog`` before its ``do`` starts: whenever its effect exists, a restarted
  daemon can undo it (``core.rollback.Undoer.replay``). ``undo`` is the in-process rollback,
  which may use what only this process holds (handles, CRIU's connection) but must do what
  the record says (through the same ``Undoer`` code);
- if a step raises (or reporting its progress, or writing its record, does), the undo of
  that step (it may have half-happened, so every undo must tolerate a partial ``do``) and
  then of every earlier step run, in reverse order;
- an undo that fails is logged and recorded as a note on the original error; it never hides
  the original error and never stops the remaining undos;
- the original exception propagates unchanged (its type, message and cause).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ckptd.core.undo import Undo, UndoLog
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
    durable: Callable[[Ctx], Undo | None] | None = None
    """The record of ``undo`` a restarted daemon runs (None: nothing outlives the process)."""


def run_steps(
    steps: Sequence[Step[Ctx]], ctx: Ctx, progress: ProgressSink = no_progress,
    undo_log: UndoLog | None = None,
) -> None:
    """Run ``steps`` over ``ctx``; on failure undo what was started, newest first. With
    ``undo_log``, each step's durable record is written there before the step starts."""
    started: list[Step[Ctx]] = []
    total = len(steps)
    for index, step in enumerate(steps):
        started.append(step)
        try:
            progress(Progress(step.name, step.describe or step.name, index / total))
            record_undo(step, ctx, undo_log)
            step.do(ctx)
        except BaseException as exc:
            _rollback(started, ctx, exc)
            raise
    progress(Progress("done", "done", 1.0))


def record_undo(step: Step[Ctx], ctx: Ctx, undo_log: UndoLog | None) -> None:
    """Write ``step``'s durable undo record (if it has one now) to ``undo_log``: what
    ``run_steps`` does before each step (a test that drives steps one by one calls it too)."""
    if undo_log is not None and step.durable is not None:
        record = step.durable(ctx)
        if record is not None:
            undo_log.record(step.name, record)


def _rollback(started: list[Step[Ctx]], ctx: Ctx, exc: BaseException) -> None:
    for step in reversed(started):
        if step.undo is None:
            continue
        try:
            step.undo(ctx)
        except Exception as undo_exc:
            log.exception("rollback of step %r failed", step.name)
            exc.add_note(f"rollback of step {step.name!r} also failed: {undo_exc}")
