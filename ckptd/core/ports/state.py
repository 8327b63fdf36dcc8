"""The daemon's own durable state: its journal of operations in flight, the dump guard
that outlives it, and the policies it schedules."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ckptd.domain import Policy


class Journal(Protocol):
    """Durable record of operations in flight, so a restarted daemon can finish or undo them."""

    def begin(self, op_id: str, facts: dict[str, Any]) -> None: ...

    def end(self, op_id: str) -> None: ...

    def pending(self) -> Iterator[tuple[str, dict[str, Any]]]: ...


class GuardPhase(enum.Enum):
    """Where a watched dump stands, as its guard must know it (``core.guard.verdict``)."""

    STOPPED = "stopped"
    """No checkpoint is listed: the tree is resumed if the daemon dies."""
    UNSURE = "unsure"
    """A commit (or its undo) is under way: whether the checkpoint is listed is unknown."""
    COMMITTED = "committed"
    """The checkpoint is listed: a killing dump's tree is to be killed."""


class TreeGuard(Protocol):
    """A watcher outside the daemon's process that finishes a dump's tree when the daemon
    dies in the middle of it, without waiting for a restart (docs/adr/0016).

    Invariants: the guard acts only once the daemon is dead, on exactly the processes named
    (held since identified: a pid given to another process later is never reached), and as
    ``CheckpointService.recover`` would (``core.guard``). Every call is best effort: a guard
    that cannot be reached is logged, never fails the operation (the journal still lets the
    next start recover it). Thread-safe: one op id per operation."""

    def watch(self, op_id: str, members: Sequence[Sequence[int]],
              stopped_before: frozenset[int], leave_running: bool) -> None:
        """Watch ``members`` (``[pid, start time]`` each; watched again: more members) of
        operation ``op_id``, in phase STOPPED unless told another."""
        ...

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        """``op_id`` is now in ``phase``; returns once a daemon dying after it is acted on
        as this phase says."""
        ...

    def release(self, op_id: str) -> None:
        """``op_id`` ended (its tree runs, or was killed): nothing to do for it any more."""
        ...


class PolicyRepo(Protocol):
    """Where policies survive a daemon restart. ``save`` replaces all of them atomically (a
    crash leaves the old set or the new one); ``load`` of nothing saved yet is empty."""

    def load(self) -> list[Policy]: ...

    def save(self, policies: Sequence[Policy]) -> None: ...
