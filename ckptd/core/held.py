"""The processes of one tree that ckptd may signal, held from the moment they were identified.

Invariants:
- the core signals, resumes, kills or waits for a process only through a ``ProcessHandle``
  opened when it was identified, with its start time checked: a process that exited and whose
  pid went to another is never reached (the handle reaches nothing);
- a pid from CRIU's images is a pid in the tree root's pid namespace. It is mapped to the
  daemon's pid through ``ProcessFact.image_pid`` of facts read from /proc, never used as a
  pid here (for the init of its own namespace, image pid 1 is not the node's pid 1);
- a pid read from the journal after a restart is reopened with the start time recorded with
  it; a pid whose process is no longer that one is left alone (start times count clock ticks:
  only a process that lived less than one tick could share one with a newcomer at its pid,
  and no checkpointed process did). See docs/adr/0008.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ckptd.core.ports import Clock, ProcessHandle, ProcessLookup
from ckptd.domain import PidState, ProcessFact

log = logging.getLogger(__name__)


class HeldTree:
    """Handles on the processes of one tree, by their pid in the daemon's namespace.

    Not thread-safe (one operation owns it); ``close`` releases every handle (idempotent)."""

    def __init__(self, processes: ProcessLookup) -> None:
        self._processes = processes
        self._handles: dict[int, ProcessHandle] = {}

    def __enter__(self) -> HeldTree:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return list(self._handles)

    def __contains__(self, pid: int) -> bool:
        return pid in self._handles

    def hold(self, pid: int, start_time: int = 0) -> bool:
        """Hold the process at ``pid`` (only if it started at ``start_time``, when given);
        False when no such process is there. Holding a held pid again is a no-op."""
        if pid in self._handles:
            return True
        handle = self._processes.open(pid, start_time)
        if handle is None:
            return False
        self._handles[pid] = handle
        return True

    def hold_facts(self, facts: Iterable[ProcessFact]) -> list[ProcessFact]:
        """Hold every process of ``facts`` (each checked against its start time); returns
        the facts whose process is held (those gone since they were read are left out)."""
        return [f for f in facts if self.hold(f.pid, f.start_time)]

    def members(self) -> list[list[int]]:
        """``[pid, start time]`` of each held process: what the journal records, so a
        restarted daemon reopens exactly these processes (``from_members``)."""
        return [[pid, h.start_time] for pid, h in self._handles.items()]

    @classmethod
    def from_members(cls, processes: ProcessLookup, members: Sequence[Any]) -> HeldTree:
        """Reopen what ``members`` recorded; a pid now held by another process is skipped."""
        held = cls(processes)
        for entry in members:
            pid, start = (int(entry[0]), int(entry[1])) if isinstance(entry, list) else (
                int(entry), 0)
            if not held.hold(pid, start):
                log.info("pid %d is no longer the process recorded; leaving it alone", pid)
        return held

    def state(self, pid: int) -> PidState:
        handle = self._handles.get(pid)
        return PidState.FREE if handle is None else handle.state()

    def signal(self, pid: int, signo: int) -> bool:
        handle = self._handles.get(pid)
        return handle is not None and handle.signal(signo)

    def signal_all(self, signo: int) -> list[int]:
        """Send ``signo`` to every held process still there; returns those reached."""
        return [pid for pid, h in self._handles.items() if h.signal(signo)]

    def stopped(self) -> list[int]:
        return [pid for pid, h in self._handles.items() if h.state() is PidState.STOPPED]

    def resume(self, stopped_before: frozenset[int] = frozenset()) -> list[int]:
        """SIGCONT to every held process stopped now that was not stopped before; returns
        them."""
        resumed = []
        for pid in self.stopped():
            if pid in stopped_before:
                continue
            log.warning("resuming pid %d left stopped", pid)
            if self._handles[pid].signal(signal.SIGCONT):
                resumed.append(pid)
        return resumed

    def wait_exit(self, pids: Iterable[int], wait_s: float, clock: Clock) -> list[int]:
        """Wait (``wait_s`` in all) until each held process of ``pids`` has exited; returns
        the pids still not dead then."""
        deadline = clock.monotonic() + wait_s
        alive = []
        for pid in pids:
            handle = self._handles.get(pid)
            if handle is not None and not handle.wait_exit(
                    max(0.0, deadline - clock.monotonic())):
                alive.append(pid)
        return alive

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def map_image_pids(
    image_pids: Iterable[int], *fact_sets: Iterable[ProcessFact]
) -> tuple[list[ProcessFact], list[int]]:
    """The facts of the processes CRIU's images name (``image_pids``, pids in the tree
    root's namespace), looked up by ``ProcessFact.image_pid`` in ``fact_sets`` (earlier sets
    first); returns them and the image pids no fact names."""
    by_image: dict[int, ProcessFact] = {}
    for facts in reversed(fact_sets):
        by_image.update({f.image_pid: f for f in facts})
    found, unknown = [], []
    for pid in image_pids:
        fact = by_image.get(pid)
        if fact is None:
            unknown.append(pid)
        else:
            found.append(fact)
    return found, unknown


def pid_map(dumped: Iterable[ProcessFact], restored: Iterable[ProcessFact]) -> Mapping[int, int]:
    """Dumped pid -> restored pid, matched by image pid (the same when the tree shares the
    node's pid namespace; new pids when it was the init of its own)."""
    by_image = {f.image_pid: f.pid for f in restored}
    return {f.pid: by_image[f.image_pid] for f in dumped if f.image_pid in by_image}
