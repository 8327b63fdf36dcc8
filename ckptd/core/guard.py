"""What a dump's guard does with the tree when the daemon dies in the middle of the dump.

The guard (``ports.TreeGuard``: a process of its own, ``adapters/guard``) is told, for each
dump in flight, the tree's processes (held by handles since they were identified), which were
stopped before the dump, whether the dump leaves the tree running, and the dump's phase. Once
the daemon is gone, ``TreeWatch.daemon_gone`` acts on every dump still watched, as
``CheckpointService.recover`` would at the next start (docs/adr/0016):

    phase      leave-running  verdict
    STOPPED    either         RESUME: SIGCONT each process stopped now and not before the dump
    UNSURE     no             RECORD_RESUME: the same, once recorded in the dump's journal
                              entry (the next start deletes the checkpoint if the commit did
                              complete: the tree ran on, as when a step after the commit fails)
    UNSURE     yes            RESUME (the tree runs on either way; the checkpoint stands)
    COMMITTED  no             KILL every process (ADR 0002: a committed tree is killed)
    COMMITTED  yes            RESUME (a CUDA tree is stopped from CRIU's end until its CUDA
                              is back, docs/adr/0019; a tree that runs has nothing stopped)

Invariants:
- nothing is decided while a member is traced (a CRIU the daemon started still holds it; on
  failure CRIU resumes what it froze by itself), waiting at most ``traced_wait_s``;
- RECORD_RESUME acts only once recorded; when recording fails nothing is done and the next
  start decides from the journal (it would otherwise kill a committed tree the guard resumed);
- only held processes are signalled: one reaped since, its pid maybe another's, is never
  reached; a process stopped before the dump stays stopped;
- the verdicts agree with ``recover`` (the table, the dump's step order and its records'
  ``unless_committed``/``if_committed`` flags say one rule three ways:
  tests/unit/test_guard.py crashes a dump after each step, its records written as
  ``run_steps`` writes them, and holds the guard's outcome and recovery's together): after
  RESUME the next start finds nothing stopped to resume and no checkpoint listed (never
  committed, or deleted as recorded); after KILL it finds the processes gone. CUDA state is
  never touched here: the next start resumes it (the tree then runs with its CUDA calls
  blocked until then: a guard never leaves a tree stopped for a daemon that may not come
  back).
"""

from __future__ import annotations

import enum
import logging
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ckptd.core.ports import Clock, GuardPhase, ProcessHandle
from ckptd.domain import PidState

log = logging.getLogger(__name__)

TRACED_WAIT_S = 10.0
"""How long the guard waits for a CRIU left by the dead daemon to let go of the tree."""


class Verdict(enum.Enum):
    RESUME = "resume"
    RECORD_RESUME = "record-resume"
    KILL = "kill"


def verdict(phase: GuardPhase, leave_running: bool) -> Verdict:
    """What to do with a watched tree whose daemon died in ``phase`` (the module's table)."""
    if phase is GuardPhase.COMMITTED and not leave_running:
        return Verdict.KILL
    if phase is GuardPhase.UNSURE and not leave_running:
        return Verdict.RECORD_RESUME
    return Verdict.RESUME


class NoGuard:
    """``TreeGuard`` that watches nothing: the journal alone lets the next start recover."""

    def watch(self, op_id: str, members: Sequence[Sequence[int]],
              stopped_before: frozenset[int], leave_running: bool) -> None:
        del op_id, members, stopped_before, leave_running

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        del op_id, phase

    def release(self, op_id: str) -> None:
        del op_id


@dataclass
class Watched:
    """One dump in flight, as its guard knows it."""

    op_id: str
    leave_running: bool
    stopped_before: frozenset[int]
    phase: GuardPhase = GuardPhase.STOPPED
    handles: dict[int, ProcessHandle] = field(default_factory=dict)


class TreeWatch:
    """The guard's state: the dumps in flight and their held trees; ``daemon_gone`` acts.

    ``traced(pid)``: whether ``pid`` is under ptrace now. ``record(op_id, verdict)``: make the
    verdict durable in the operation's journal entry; False when that failed (True also when
    the entry is gone: the daemon had ended the operation). Not thread-safe (one loop)."""

    def __init__(
        self,
        *,
        traced: Callable[[int], bool],
        record: Callable[[str, Verdict], bool],
        clock: Clock,
        traced_wait_s: float = TRACED_WAIT_S,
    ) -> None:
        self._traced = traced
        self._record = record
        self._clock = clock
        self._traced_wait_s = traced_wait_s
        self._ops: dict[str, Watched] = {}

    @property
    def watched(self) -> list[str]:
        return list(self._ops)

    def get(self, op_id: str) -> Watched | None:
        return self._ops.get(op_id)

    def watch(self, op_id: str, leave_running: bool, stopped_before: frozenset[int]) -> None:
        """Start watching ``op_id`` (or update what is known of it; its phase is kept)."""
        known = self._ops.get(op_id)
        if known is None:
            self._ops[op_id] = Watched(op_id, leave_running, stopped_before)
        else:
            known.leave_running, known.stopped_before = leave_running, stopped_before

    def hold(self, op_id: str, handles: Iterable[ProcessHandle]) -> None:
        """Add processes to ``op_id``'s tree; a pid already held keeps its first handle (the
        new one is closed). Handles for an operation not watched are closed."""
        known = self._ops.get(op_id)
        for handle in handles:
            if known is None or handle.pid in known.handles:
                handle.close()
            else:
                known.handles[handle.pid] = handle

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        known = self._ops.get(op_id)
        if known is not None:
            known.phase = phase

    def release(self, op_id: str) -> None:
        known = self._ops.pop(op_id, None)
        if known is not None:
            _close(known)

    def close(self) -> None:
        for op_id in list(self._ops):
            self.release(op_id)

    def daemon_gone(self) -> list[str]:
        """The daemon died: act on every dump still watched (see the module doc), release
        it, and return one line per dump saying what was done."""
        self._wait_untraced()
        done = []
        for op_id in list(self._ops):
            known = self._ops[op_id]
            try:
                done.append(f"{op_id}: {self._act(known)}")
            finally:
                self.release(op_id)
        return done

    def _act(self, known: Watched) -> str:
        what = verdict(known.phase, known.leave_running)
        where = f"the daemon died with the dump {known.phase.value}"
        if what is Verdict.KILL:
            killed = [p for p, h in known.handles.items() if h.signal(signal.SIGKILL)]
            return f"{where}: killed {killed or 'nothing (gone)'}"
        if what is Verdict.RECORD_RESUME and not self._record(known.op_id, what):
            return (f"{where}: could not record the resume in its journal entry; left as "
                    "it is for the next start")
        resumed, traced = [], []
        for pid, handle in known.handles.items():
            if pid in known.stopped_before or handle.state() is not PidState.STOPPED:
                continue
            if self._traced(pid):
                traced.append(pid)
            elif handle.signal(signal.SIGCONT):
                resumed.append(pid)
        line = f"{where}: resumed {resumed or 'nothing (none stopped)'}"
        return line + (f"; still traced, not resumed: {traced}" if traced else "")

    def _wait_untraced(self) -> None:
        deadline = self._clock.monotonic() + self._traced_wait_s
        while True:
            traced = [p for w in self._ops.values() for p, h in w.handles.items()
                      if h.state() not in (PidState.FREE, PidState.ZOMBIE) and self._traced(p)]
            if not traced:
                return
            if self._clock.monotonic() >= deadline:
                log.error("pids %s still traced after %.0fs", traced, self._traced_wait_s)
                return
            self._clock.sleep(0.05)


def _close(known: Watched) -> None:
    for handle in known.handles.values():
        handle.close()
    known.handles.clear()
