"""``ThreadHold`` over ptrace: every thread of a process but one held in a ptrace stop.

How (docs/adr/0019), as CRIU's CUDA plugin keeps a restored process frozen while the driver's
restore thread runs (criu plugins/cuda/cuda_plugin.c, ``resume_device``):

- ``hold``: every thread of ``/proc/PID/task`` but the free one is ``PTRACE_SEIZE`` d and
  ``PTRACE_INTERRUPT`` ed, and waited for (``waitpid(tid, __WALL)``) until it reports its
  stop; the task list is read again until a round finds no thread not yet held (a thread
  created meanwhile is held too). The free thread is never traced: once the process is not
  stopped (a SIGCONT: a seized thread in a ptrace stop stays there, the kernel wakes only
  the others), it alone runs.
- ``release``: ``PTRACE_DETACH`` of every held thread, handing back a signal it stopped for
  (a signal-delivery stop), so nothing is lost; a thread of a process still stopped by a
  signal stays stopped with it.

ptrace is per thread: every request for a tracee must come from the thread that seized it.
Each hold gets a lane of its own (a one-thread executor, like the CUDA worker's lanes), on
which its seize, waits and detach all run; the lane's thread ends after the release. If that
thread, or the daemon, dies while holding, the kernel detaches its tracees, which run again
(a daemon crash never leaves a job held) — so keep the ``PtraceThreadHold`` while holding:
collected, its lanes' threads end and the holds with them. Waiting is bounded
(``stop_timeout_s``): a thread that does not stop (uninterruptible sleep) fails the hold,
everything already held released.

Nothing else in the daemon may ``waitpid(-1, __WALL)`` (it would take these stops' reports);
``subprocess`` waits for its own pids only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ckptd.errors import PreconditionFailed, ProcessNotFound

__all__ = ["PtraceThreadHold"]

T = TypeVar("T")

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
MAX_ROUNDS = 100
"""Task-list reads at most: a process that keeps making threads faster than they are held
fails the hold."""

_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def _call(request: int, tid: int, data: int = 0) -> int:
    """``ptrace(request, tid, 0, data)``: 0, or the errno it failed with."""
    ctypes.set_errno(0)
    if _ptrace(request, tid, None, ctypes.c_void_p(data) if data else None) == -1:
        return ctypes.get_errno() or errno.EIO
    return 0


@dataclass
class _Hold:
    pid: int
    free_tid: int
    lane: ThreadPoolExecutor
    held: dict[int, int] = field(default_factory=dict)
    """tid -> the signal to hand back at detach (0: none)."""

    def on_lane(self, fn: Callable[[], T]) -> T:
        return self.lane.submit(fn).result()


class PtraceThreadHold:
    """``ThreadHold`` for processes of this node (pids of the daemon's namespace)."""

    def __init__(self, proc: Path = Path("/proc"), stop_timeout_s: float = 10.0) -> None:
        self._proc = proc
        self._stop_timeout_s = stop_timeout_s
        self._lock = threading.Lock()
        self._holds: dict[int, _Hold] = {}

    def hold(self, pid: int, free_tid: int) -> tuple[int, ...]:
        tids = self._tasks(pid)
        if free_tid not in tids:
            raise PreconditionFailed(
                f"cannot hold the threads of pid {pid}: {free_tid} is not one of its threads",
                hint="ask the driver for the process's restore thread again", pid=pid)
        with self._lock:
            if pid in self._holds:
                raise PreconditionFailed(f"the threads of pid {pid} are already held",
                                         hint="release them first", pid=pid)
            hold = _Hold(pid, free_tid,
                         ThreadPoolExecutor(1, thread_name_prefix=f"ckptd-hold-{pid}"))
            self._holds[pid] = hold
        try:
            hold.on_lane(lambda: self._seize_all(hold))
        except BaseException:
            self.release(pid)
            raise
        return tuple(sorted(hold.held))

    def release(self, pid: int) -> None:
        with self._lock:
            hold = self._holds.pop(pid, None)
        if hold is None:
            return
        with contextlib.suppress(Exception):
            hold.on_lane(lambda: self._detach_all(hold))
        hold.lane.shutdown(wait=True)

    # ---- on the hold's lane ----------------------------------------------------------------

    def _seize_all(self, hold: _Hold) -> None:
        for _ in range(MAX_ROUNDS):
            new = [t for t in self._tasks(hold.pid) if t != hold.free_tid and t not in hold.held]
            if not new:
                return
            seized = []
            for tid in new:
                err = _call(PTRACE_SEIZE, tid)
                if err == errno.ESRCH:
                    continue  # the thread ended meanwhile
                if err:
                    raise PreconditionFailed(
                        f"cannot hold thread {tid} of pid {hold.pid}: ptrace: "
                        f"{os.strerror(err)}",
                        hint="another tracer (a debugger, strace) holds it, or ptrace is "
                        "not permitted (kernel.yama.ptrace_scope 3): detach it or lower it",
                        pid=hold.pid)
                hold.held[tid] = 0
                seized.append(tid)
                _call(PTRACE_INTERRUPT, tid)
            for tid in seized:
                self._wait_stopped(hold, tid)
        raise PreconditionFailed(
            f"cannot hold the threads of pid {hold.pid}: it makes new threads faster than "
            "they are held", hint="retry", pid=hold.pid)

    def _wait_stopped(self, hold: _Hold, tid: int) -> None:
        """Until ``tid`` reports a stop (kept), or has ended (forgotten); bounded."""
        deadline = time.monotonic() + self._stop_timeout_s
        while True:
            try:
                got, status = os.waitpid(tid, WALL | os.WNOHANG)
            except ChildProcessError:
                hold.held.pop(tid, None)  # ended and gone
                return
            if got == tid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    hold.held.pop(tid, None)
                    return
                if os.WIFSTOPPED(status):
                    sig = os.WSTOPSIG(status)
                    event = status >> 16
                    # a signal-delivery stop: the signal is handed back at detach
                    if event == 0 and sig != signal.SIGTRAP:
                        hold.held[tid] = sig
                    return
            if time.monotonic() >= deadline:
                raise PreconditionFailed(
                    f"thread {tid} of pid {hold.pid} did not stop within "
                    f"{self._stop_timeout_s:g}s of being interrupted (uninterruptible sleep?)",
                    hint="retry once the process is not blocked in the kernel", pid=hold.pid)
            time.sleep(0.001)

    @staticmethod
    def _detach_all(hold: _Hold) -> None:
        for tid, sig in list(hold.held.items()):
            _call(PTRACE_DETACH, tid, sig)  # ESRCH: ended meanwhile
            del hold.held[tid]

    def _tasks(self, pid: int) -> list[int]:
        try:
            return sorted(int(n) for n in os.listdir(self._proc / str(pid) / "task"))
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessNotFound(f"pid {pid} is gone: its threads cannot be held",
                                  pid=pid) from exc
