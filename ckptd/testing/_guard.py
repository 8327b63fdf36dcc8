"""``FakeTreeGuard``: the dump guard's port (``TreeGuard``, docs/adr/0016) in this process."""

from __future__ import annotations

from collections.abc import Sequence

from ckptd.core.guard import TreeWatch, Verdict
from ckptd.core.ports import GuardPhase, Journal, ProcessHandle
from ckptd.core.undo import BadEntry, with_guard_resumed
from ckptd.testing._clock import FakeClock
from ckptd.testing._processes import FakeProcessTable


class FakeTreeGuard:
    """``TreeGuard`` feeding ``core.guard.TreeWatch`` (the guard process's own logic) in this
    process, without a socket or a process of its own: the members are held as handles of
    a ``FakeProcessTable`` when watched, and the test says when the daemon has died
    (``daemon_gone``: the watch acts then, returning its summary lines).

    Like the guard process: a RECORD_RESUME verdict is written into the operation's journal
    entry (``with_guard_resumed``) before the tree is resumed; an entry that is not a typed
    dump entry is not written and the tree is left to the next start; an entry already gone
    counts as recorded. ``calls`` lists what it was told, in order ("watch N", "phase P",
    "release"); ``events``, when given, gets the same lines prefixed by "guard "."""

    def __init__(self, processes: FakeProcessTable, journal: Journal,
                 clock: FakeClock | None = None, *, traced_wait_s: float = 2.0,
                 events: list[str] | None = None) -> None:
        self.processes = processes
        self.journal = journal
        self.calls: list[str] = []
        self._events = events
        self.watch_state = TreeWatch(
            traced=lambda pid: processes.status(pid).traced, record=self._record,
            clock=clock or FakeClock(), traced_wait_s=traced_wait_s)

    def watch(self, op_id: str, members: Sequence[Sequence[int]],
              stopped_before: frozenset[int], leave_running: bool) -> None:
        self._said(f"watch {len(members)}")
        self.watch_state.watch(op_id, leave_running, stopped_before)
        handles: list[ProcessHandle] = []
        for member in members:
            handle = self.processes.open(int(member[0]), int(member[1]))
            if handle is not None:
                handles.append(handle)
        self.watch_state.hold(op_id, handles)

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        self._said(f"phase {phase.value}")
        self.watch_state.phase(op_id, phase)

    def release(self, op_id: str) -> None:
        self._said("release")
        self.watch_state.release(op_id)

    def daemon_gone(self) -> list[str]:
        """The daemon died: act on every operation still watched (``TreeWatch``)."""
        return self.watch_state.daemon_gone()

    def _record(self, op_id: str, verdict: Verdict) -> bool:
        del verdict  # only RECORD_RESUME is recorded: a GuardResumed undo record
        for pending, facts in self.journal.pending():
            if pending == op_id:
                try:
                    self.journal.begin(op_id, with_guard_resumed(facts))
                except BadEntry:
                    return False
        return True

    def _said(self, line: str) -> None:
        self.calls.append(line)
        if self._events is not None:
            self._events.append(f"guard {line}")
