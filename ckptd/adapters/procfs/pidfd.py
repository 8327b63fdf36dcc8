"""``ProcessHandle`` over a Linux pidfd: signals reach the process that was identified, never
one that got its pid later.

A pidfd names one process (not a pid): ``pidfd_send_signal`` on it fails with ESRCH once that
process is reaped, even if its pid has been given to another; the pidfd turns readable when
the process exits. Identity at opening: the start time is read from /proc/PID/stat *after* the
pidfd is opened and checked while the pidfd says the process is still alive (a live process
keeps its pid, so what was read was its own)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
from pathlib import Path

from ckptd.domain import PidState

_STOPPED = {"T", "t"}


def read_stat(pid: int, proc: Path) -> list[str] | None:
    """Fields of /proc/PID/stat with ``comm`` as field 1 (it may contain spaces); None when
    the process is gone."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    lpar, rpar = raw.index("("), raw.rindex(")")
    return [raw[:lpar].strip(), raw[lpar + 1 : rpar], *raw[rpar + 2 :].split()]


_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)
_libc = ctypes.CDLL(None, use_errno=True)


def getfd(pid: int, target: int) -> int:
    """A descriptor of process ``pid``'s descriptor ``target`` (``pidfd_getfd``, close-on-exec):
    the process's own open file description, not a new open(2) of the file, so a lease on it
    is not broken; its offset is the process's (read it with pread, never move it). OSError
    when the process or the descriptor is gone."""
    pidfd = os.pidfd_open(pid)
    try:
        fd = int(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, target, 0))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd of {pid}'s descriptor {target}: {os.strerror(err)}")
        return fd
    finally:
        os.close(pidfd)


PF_EXITING = 0x4
"""/proc/PID/stat's flags bit of a task in exit: it never runs user code again."""


def state_of(fields: list[str]) -> PidState:
    """A task exiting (PF_EXITING: its memory may already be gone, it is not yet a zombie)
    counts as a zombie: it is over, and what watched its memory (a userfaultfd) has seen it
    end."""
    if fields[2] in ("Z", "X") or int(fields[8]) & PF_EXITING:
        return PidState.ZOMBIE
    if fields[2] in _STOPPED:
        return PidState.STOPPED
    return PidState.RUNNING


class PidfdHandle:
    """A process held by a pidfd (see the module doc). Not thread-safe; close when done."""

    def __init__(self, fd: int, pid: int, start_time: int, proc: Path) -> None:
        self._fd = fd
        self._pid = pid
        self._start_time = start_time
        self._proc = proc

    @classmethod
    def open(cls, pid: int, start_time: int = 0, proc: Path = Path("/proc")) -> PidfdHandle | None:
        """The process at ``pid`` now (and, with ``start_time``, only if it started then);
        None when there is none (or only a thread of that id, or another process)."""
        if pid <= 0:
            return None
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):  # ESRCH; EINVAL: a thread id, not a process
            return None
        handle = cls(fd, pid, 0, proc)
        fields = read_stat(pid, proc)
        if fields is None or not handle._alive() or len(fields) <= 21:
            handle.close()
            return None
        handle._start_time = int(fields[21])
        if start_time and handle._start_time != start_time:
            handle.close()
            return None
        return handle

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def start_time(self) -> int:
        return self._start_time

    def fileno(self) -> int:
        """The pidfd (-1 once closed): to hand the same process to another (SCM_RIGHTS)."""
        return self._fd

    def _alive(self) -> bool:
        """Not reaped yet (a zombie counts: it still holds its pid)."""
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except ProcessLookupError:
            return False
        return True

    def _exited(self, timeout_s: float = 0.0) -> bool:
        if self._fd < 0:
            return True
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))

    def signal(self, signo: int) -> bool:
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, signo)
        except ProcessLookupError:
            return False
        return True

    def state(self) -> PidState:
        if not self._alive():
            return PidState.FREE
        if self._exited():
            return PidState.ZOMBIE
        fields = read_stat(self._pid, self._proc)
        if not self._alive():  # died while we read: what we read may not be its own
            return PidState.FREE
        if fields is None:
            return PidState.ZOMBIE
        return state_of(fields)

    def wait_exit(self, timeout_s: float) -> bool:
        return self._exited(timeout_s)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"PidfdHandle(pid={self._pid}, start_time={self._start_time})"
