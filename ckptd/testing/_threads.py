"""``FakeThreadHold``: a ``ThreadHold`` over a ``FakeProcessTable``."""

from __future__ import annotations

import threading

from ckptd.core.ports import ThreadHold
from ckptd.domain import PidState
from ckptd.errors import PreconditionFailed, ProcessNotFound
from ckptd.testing._processes import FakeProcessTable


class FakeThreadHold:
    """Fake processes have one thread of their own (tid = pid) besides the one the driver
    restores on (``FakeGpu.restore_thread``): ``hold(pid, free_tid)`` holds "every thread but
    ``free_tid``", i.e. records ``held[pid] = free_tid`` and returns ``(pid,)`` (``()`` when
    ``free_tid`` is the pid itself). Held threads are nothing the fake processes act on;
    ``FakeGpu`` (given this hold as ``threads``) checks them at restore / unlock.

    A pid that is free or a zombie raises ``ProcessNotFound``; one in ``fail_hold`` raises
    ``PreconditionFailed`` and holds nothing; holding a pid held already raises too.
    Records ``held`` (pid -> its free tid, while held), ``history`` (``("hold", pid,
    free_tid)`` / ``("release", pid, 0)`` in order); with ``events``, ``"threads.hold <pid>"``
    and ``"threads.release <pid>"``. A release tells the table's ``watchers`` the process's
    state again (its threads run now if it is RUNNING). Thread-safe."""

    def __init__(self, processes: FakeProcessTable | None = None,
                 events: list[str] | None = None) -> None:
        self._lock = threading.Lock()
        self.processes = processes
        self.events = events
        self.held: dict[int, int] = {}
        self.history: list[tuple[str, int, int]] = []
        self.fail_hold: set[int] = set()

    def hold(self, pid: int, free_tid: int) -> tuple[int, ...]:
        with self._lock:
            if self.processes is not None and self.processes.status(pid).state in (
                    PidState.FREE, PidState.ZOMBIE):
                raise ProcessNotFound(f"pid {pid} is gone: its threads cannot be held",
                                      pid=pid)
            if pid in self.fail_hold:
                raise PreconditionFailed(f"cannot hold thread {pid} of pid {pid}: injected",
                                         pid=pid)
            if pid in self.held:
                raise PreconditionFailed(f"the threads of pid {pid} are already held",
                                         pid=pid)
            self.held[pid] = free_tid
            self.history.append(("hold", pid, free_tid))
            if self.events is not None:
                self.events.append(f"threads.hold {pid}")
            return () if free_tid == pid else (pid,)

    def release(self, pid: int) -> None:
        with self._lock:
            if self.held.pop(pid, None) is None:
                return
            self.history.append(("release", pid, 0))
            if self.events is not None:
                self.events.append(f"threads.release {pid}")
        if self.processes is not None:  # its threads run now, if it does
            self.processes.tell_watchers(pid)


def _is_a_thread_hold(hold: FakeThreadHold) -> ThreadHold:
    return hold
