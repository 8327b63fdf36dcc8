"""``ProcessTable`` over /proc (the daemon's pid namespace); signals through pidfds.

A process that dies while its /proc files are read (the kernel answers ENOENT or ESRCH) is
reported as gone, never as an error: callers poll processes they just killed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckptd.adapters.procfs.pidfd import PidfdHandle, read_stat, state_of
from ckptd.adapters.procfs.tcp import tcp_connections
from ckptd.domain import PidState, PidStatus, ProcessFact, StdioFact, StdioKind, TcpConnection
from ckptd.errors import ProcessNotFound

PF_KTHREAD = 0x00200000


def _ns_pid(status: str, level: int) -> int:
    """The pid at ``level`` of NSpid (0 for level 0 or when unknown)."""
    pids = _ns_pids(status)
    return pids[level] if 0 < level < len(pids) else 0


def owner_uid(status: str) -> int:
    """The uid a process acts as, from /proc/PID/status: its real, effective, saved and
    file-system uids when they all agree; 0 (root) otherwise, so that a set-uid process is
    never taken for its invoker's."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uids = {int(u) for u in line.split()[1:5]}
            return uids.pop() if len(uids) == 1 else 0
    return 0


def _status_int(status: str, key: str) -> int:
    """The number of ``key`` (``"Tgid:"``) in /proc/PID/status; 0 when absent."""
    for line in status.splitlines():
        if line.startswith(key):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return 0


def _ns_pids(status: str) -> tuple[int, ...]:
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(p) for p in line.split()[1:])
    return ()


IO_URING = "anon_inode:[io_uring]"
"""What /proc/PID/fd/N links to, and /proc/PID/maps names, for an io_uring instance."""
IO_URING_MAPPED = IO_URING.encode() + b"\n"
"""A line of /proc/PID/maps ends with it where the rings of one are mapped."""

NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup", "time")


class ProcFsTable:
    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc

    def status(self, pid: int) -> PidStatus:
        fields = read_stat(pid, self._proc) if pid > 0 else None
        if fields is None:
            return PidStatus(pid, PidState.FREE)
        ppid, session, flags = int(fields[3]), int(fields[5]), int(fields[8])
        start_time = int(fields[21]) if len(fields) > 21 else 0
        state = state_of(fields)
        try:
            status_text = (self._proc / str(pid) / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return PidStatus(pid, PidState.FREE)
        uid = owner_uid(status_text)
        tracer, tgid = _status_int(status_text, "TracerPid:"), _status_int(status_text, "Tgid:")
        return PidStatus(
            pid, state, ppid=ppid, comm=fields[1], uid=uid, traced=tracer != 0, tracer=tracer,
            tgid=tgid, session=session,
            start_time=start_time, ns_pids=_ns_pids(status_text),
            kernel_thread=bool(flags & PF_KTHREAD),  # reliable; pid 2 may be anything in a pid ns
        )

    def _fact(self, pid: int, level: int = 0) -> ProcessFact | None:
        """``pid``'s facts; ``ns_pid`` its pid at ``level`` of its NSpid (the level of the
        tree root's own pid namespace; 0: the daemon's, where ``ns_pid`` is left 0)."""
        base = self._proc / str(pid)
        fields = read_stat(pid, self._proc)
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
            start_time=int(fields[21]) if len(fields) > 21 else 0,
            ns_pid=_ns_pid(status, level),
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
        try:
            level = len(_ns_pids((self._proc / str(pid) / "status").read_text())) - 1
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            level = 0
        root = self._fact(pid, level)
        if root is None:
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        out = [root]
        queue = self._children(pid)
        while queue:
            child = queue.pop(0)
            fact = self._fact(child, level)
            if fact is not None:
                out.append(fact)
                queue.extend(self._children(child))
        return tuple(out)

    def ancestors(self, pid: int) -> tuple[int, ...]:
        chain: list[int] = []
        current = pid
        while current > 1:
            fields = read_stat(current, self._proc)
            if fields is None:
                break
            current = int(fields[3])
            if current <= 0:
                break
            chain.append(current)
        return tuple(chain)

    def open(self, pid: int, start_time: int = 0) -> PidfdHandle | None:
        return PidfdHandle.open(pid, start_time, self._proc)

    def foreign_namespaces(self, pid: int) -> frozenset[str]:
        out = set()
        for name in NAMESPACES:
            try:
                mine = os.readlink(self._proc / "self" / "ns" / name)
                theirs = os.readlink(self._proc / str(pid) / "ns" / name)
            except OSError:  # gone, or a kernel without this namespace
                continue
            if mine != theirs:
                out.add(name)
        return frozenset(out)

    def pid_namespace_init(self, pid: int) -> int:
        """Walks up the parents: a process's ancestors inside its pid namespace end at that
        namespace's init (orphans are reparented to it), whose parent is outside."""
        try:
            mine = os.stat(self._proc / "self" / "ns" / "pid").st_ino
            theirs = os.stat(self._proc / str(pid) / "ns" / "pid").st_ino
        except OSError:
            return 0
        if mine == theirs:
            return 0
        for candidate in (pid, *self.ancestors(pid)):
            try:
                if os.stat(self._proc / str(candidate) / "ns" / "pid").st_ino != theirs:
                    return 0
                status = (self._proc / str(candidate) / "status").read_text()
            except (OSError, ProcessLookupError):
                return 0
            nspids = _ns_pids(status)
            if nspids and nspids[-1] == 1:
                return candidate
        return 0

    def namespaces_differing(self, pid: int, other: int) -> frozenset[str]:
        out = set()
        for name in NAMESPACES:
            if not (self._proc / "self" / "ns" / name).exists():
                continue  # a kernel without this kind
            try:
                one = os.readlink(self._proc / str(pid) / "ns" / name)
                two = os.readlink(self._proc / str(other) / "ns" / name)
            except OSError:  # either is gone
                return frozenset(NAMESPACES)
            if one != two:
                out.add(name)
        return frozenset(out)

    def reserve_pids(self, pid: int, above: int, start_time: int = 0) -> int:
        """The namespace is the one ``Container.open`` pinned (its descriptors opened while
        a pidfd said the process was alive, its start time read then), so a pid reused
        between the caller's check and here never names another's namespace."""
        if "pid" not in self.foreign_namespaces(pid):
            if not (self._proc / str(pid)).exists():
                raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
            return 0
        from ckptd.adapters.criu.containers import Container, ContainerError

        try:
            with Container.open(pid) as container:
                if start_time and container.start_time != start_time:
                    raise ProcessNotFound(
                        f"pid {pid} holds another process than the one asked for (started "
                        f"at {container.start_time}, not {start_time})", pid=pid)
                return container.raise_last_pid(above)
        except ContainerError as exc:
            raise ProcessNotFound(f"cannot reserve pids for pid {pid}: {exc}", pid=pid) from exc

    def own_root(self, pid: int) -> bool:
        try:
            theirs = os.stat(self._proc / str(pid) / "root")
            ours = os.stat("/")
        except OSError:
            return False
        return (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)

    def ns_pid_taken(self, init: int, ns_pid: int) -> str:
        """Through the container's own /proc (its pid namespace's; every task id is there,
        threads too), reached in its root without following links."""
        from ckptd.adapters.procfs.rootpath import ContainerPathError, in_root, process_root

        try:
            where = in_root(process_root(self._proc, init), f"/proc/{int(ns_pid)}/comm")
            return Path(where).read_text().strip() or "?"
        except FileNotFoundError:
            if not (self._proc / str(init)).exists():
                raise ProcessNotFound(f"no process with pid {init}", pid=init) from None
            if not Path(in_root(process_root(self._proc, init), "/proc/1")).exists():
                raise ProcessNotFound(
                    f"the container of pid {init} has no /proc mounted: its pids cannot be "
                    "told", pid=init) from None
            return ""
        except ProcessLookupError:
            return ""
        except ContainerPathError as exc:
            raise ProcessNotFound(f"the pids of the container of pid {init} cannot be told: "
                                  f"{exc}", pid=init) from exc

    def tcp_connections(self, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
        return tcp_connections(self._proc, tree)

    def io_uring_holders(self, tree: Sequence[ProcessFact]) -> tuple[int, ...]:
        return tuple(p.pid for p in tree if self._holds_io_uring(p.pid))

    def _holds_io_uring(self, pid: int) -> bool:
        """An fd whose link is ``anon_inode:[io_uring]``, or a mapping of one (the rings stay
        mapped after the fd is closed)."""
        base = self._proc / str(pid)
        try:
            fds = os.listdir(base / "fd")
        except (FileNotFoundError, ProcessLookupError):
            fds = []
        for fd in fds:
            try:
                if os.readlink(base / "fd" / fd) == IO_URING:
                    return True
            except OSError:  # closed meanwhile
                continue
        try:
            with open(base / "maps", "rb") as maps:
                return any(
                    b"io_uring" in line and line.split(maxsplit=5)[5:] == [IO_URING_MAPPED]
                    for line in maps
                )
        except (FileNotFoundError, ProcessLookupError):
            return False

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
