"""``ProcessTable`` over /proc (host pid namespace).

A process that dies while its /proc files are read (the kernel answers ENOENT or ESRCH) is
reported as gone, never as an error: callers poll processes they just killed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckptd.domain import PidState, PidStatus, ProcessFact, StdioFact, StdioKind
from ckptd.errors import ProcessNotFound

PF_KTHREAD = 0x00200000
_STOPPED = {"T", "t"}


def owner_uid(status: str) -> int:
    """The uid a process acts as, from /proc/PID/status: its real, effective, saved and
    file-system uids when they all agree; 0 (root) otherwise, so that a set-uid process is
    never taken for its invoker's."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uids = {int(u) for u in line.split()[1:5]}
            return uids.pop() if len(uids) == 1 else 0
    return 0


def _read_stat(pid: int, proc: Path) -> list[str] | None:
    """Fields of /proc/PID/stat with ``comm`` as field 1 (it may contain spaces)."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    lpar, rpar = raw.index("("), raw.rindex(")")
    return [raw[:lpar].strip(), raw[lpar + 1 : rpar], *raw[rpar + 2 :].split()]


class ProcFsTable:
    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc

    def status(self, pid: int) -> PidStatus:
        fields = _read_stat(pid, self._proc) if pid > 0 else None
        if fields is None:
            return PidStatus(pid, PidState.FREE)
        state_char, ppid, session, flags = (
            fields[2], int(fields[3]), int(fields[5]), int(fields[8])
        )
        start_time = int(fields[21]) if len(fields) > 21 else 0
        if state_char in ("Z", "X"):
            state = PidState.ZOMBIE
        elif state_char in _STOPPED:
            state = PidState.STOPPED
        else:
            state = PidState.RUNNING
        try:
            status_text = (self._proc / str(pid) / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return PidStatus(pid, PidState.FREE)
        uid = owner_uid(status_text)
        traced = any(
            line.startswith("TracerPid:") and line.split()[1] != "0"
            for line in status_text.splitlines()
        )
        return PidStatus(
            pid, state, ppid=ppid, comm=fields[1], uid=uid, traced=traced, session=session,
            start_time=start_time,
            kernel_thread=bool(flags & PF_KTHREAD),  # reliable; pid 2 may be anything in a pid ns
        )

    def _fact(self, pid: int) -> ProcessFact | None:
        base = self._proc / str(pid)
        fields = _read_stat(pid, self._proc)
        if fields is None:
            return None
        try:
            cmdline = (base / "cmdline").read_bytes().split(b"\0")
            status = (base / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        ids = {
            line.split(":")[0]: line.split()[1]
            for line in status.splitlines()
            if line.startswith(("Gid:", "Threads:", "VmRSS:"))
        }
        return ProcessFact(
            pid=pid,
            ppid=int(fields[3]),
            comm=fields[1],
            cmdline=tuple(c.decode(errors="replace") for c in cmdline if c),
            uid=owner_uid(status),
            gid=int(ids.get("Gid", 0)),
            threads=int(ids.get("Threads", 1)),
            rss=int(ids.get("VmRSS", 0)) * 1024,
        )

    def _children(self, pid: int) -> list[int]:
        kids: list[int] = []
        try:
            tasks = list((self._proc / str(pid) / "task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            return kids
        for task in tasks:
            try:
                kids.extend(int(c) for c in (task / "children").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue
        return sorted(set(kids))

    def tree(self, pid: int) -> tuple[ProcessFact, ...]:
        root = self._fact(pid)
        if root is None:
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        out = [root]
        queue = self._children(pid)
        while queue:
            child = queue.pop(0)
            fact = self._fact(child)
            if fact is not None:
                out.append(fact)
                queue.extend(self._children(child))
        return tuple(out)

    def ancestors(self, pid: int) -> tuple[int, ...]:
        chain: list[int] = []
        current = pid
        while current > 1:
            fields = _read_stat(current, self._proc)
            if fields is None:
                break
            current = int(fields[3])
            if current <= 0:
                break
            chain.append(current)
        return tuple(chain)

    def signal(self, pid: int, signo: int) -> bool:
        try:
            os.kill(pid, signo)
        except ProcessLookupError:
            return False
        return True

    def stdio(self, tree: Sequence[ProcessFact]) -> tuple[StdioFact, ...]:
        """Stdio of every process; pipes held only on one side by the tree, and terminals
        whose master the tree does not hold, are external."""
        pipe_modes: dict[str, set[int]] = {}
        holds_ptmx = False
        for proc in tree:
            for fd, target, mode in self._fds(proc.pid):
                del fd
                if target.startswith("pipe:"):
                    pipe_modes.setdefault(target, set()).add(mode)
                elif target == "/dev/ptmx" or target.startswith("/dev/pts/ptmx"):
                    holds_ptmx = True
        out: list[StdioFact] = []
        for proc in tree:
            for fd, target, mode in self._fds(proc.pid, only=(0, 1, 2)):
                kind = _kind(target)
                key = ""
                if kind is StdioKind.PIPE:
                    modes = pipe_modes.get(target, set())
                    if not ({0, 2} & modes and {1, 2} & modes):
                        key = target
                elif kind is StdioKind.TTY and not holds_ptmx:
                    key = self._tty_key(proc.pid, fd)
                out.append(StdioFact(proc.pid, fd, kind, target, mode in (1, 2), key))
        return tuple(out)

    def _fds(self, pid: int, only: tuple[int, ...] | None = None) -> list[tuple[int, str, int]]:
        base = self._proc / str(pid)
        try:
            fds = [int(n) for n in os.listdir(base / "fd")]
        except (FileNotFoundError, ProcessLookupError):
            return []
        out = []
        for fd in sorted(fds):
            if only is not None and fd not in only:
                continue
            try:
                target = os.readlink(base / "fd" / str(fd))
                flags = (base / "fdinfo" / str(fd)).read_text().split("flags:")[1].split()[0]
            except (FileNotFoundError, IndexError):
                continue
            out.append((fd, target, int(flags, 8) & 3))
        return out

    def _tty_key(self, pid: int, fd: int) -> str:
        """CRIU's name of a terminal: ``tty[rdev:dev]`` in hex."""
        st = os.stat(self._proc / str(pid) / "fd" / str(fd))
        return f"tty[{st.st_rdev:x}:{st.st_dev:x}]"


def _kind(target: str) -> StdioKind:
    if target.startswith("pipe:"):
        return StdioKind.PIPE
    if target.startswith("socket:"):
        return StdioKind.SOCKET
    if target == "/dev/null":
        return StdioKind.DEVNULL
    if target.startswith(("/dev/pts/", "/dev/tty", "/dev/console")):
        return StdioKind.TTY
    if target.startswith("/"):
        return StdioKind.FILE
    return StdioKind.OTHER
