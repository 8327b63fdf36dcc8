"""CRIU run *inside* a container's namespaces and cgroups (issue #12 groundwork).

A job in a container (runc, crun, podman, a Kubernetes pod) shares the container's pid, mount,
network, ipc, uts and cgroup namespaces with the container's init (``ckptctl run``), and is not
that init. CRIU run from the node sees all of those as the job's *own* namespaces: it refuses
the pid namespace without its init (``--external pid[...]`` gets past that), dumps the mount
tree and network namespace, and on restore builds a *new* mount and cgroup namespace and
leaves the restored tree a child of the node's init. CRIU run from inside the container sees
none of them as the job's own: it dumps a plain process tree, and a restore run inside
*another* container (the next pod) recreates the tree in that container's namespaces,
cgroups and root filesystem, with the container's init as the tree's parent once CRIU exits.
docs/design/containers.md has the measurements and CRIU's errors for both ways.

This module runs a command (CRIU) that way:

- every namespace but the user and time ones is entered from descriptors opened once
  (:class:`Container` pins them, with a pidfd checking they were its process's), so a
  container that goes away or a pid taken by another process is never entered by mistake;
- the command is moved into the container's cgroups first (every hierarchy: cgroup v2 and
  v1's), so what CRIU restores lands there (and a container removed meanwhile kills it);
- the pid namespace is entered by ``nsenter``'s fork: CRIU is a process *of* that namespace
  (its ``/proc`` shows it, its children are born there, and what it leaves behind is
  reparented to the container's init);
- the mount namespace is entered either by ``nsenter`` (CRIU must then be in the container's
  root filesystem) or, with ``preload`` (``native/enter-mntns``), by a constructor run after
  CRIU and its libraries were loaded from the node: any image works.

It only builds and runs commands; the restore recipe, the store and the daemon are unchanged.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ckptd._gen.criu import pstree_pb2
from ckptd.adapters.criu.images import IMG_COMMON_MAGIC, PSTREE_MAGIC
from ckptd.adapters.criu.logs import first_error_line

ENTERED = ("pid", "net", "ipc", "uts", "cgroup", "mnt")
"""The namespaces CRIU enters; user and time are the node's in rootful containers (checked)."""

SAME_AS_NODE = ("user", "time")

_NSENTER = {"pid": "--pid", "net": "--net", "ipc": "--ipc", "uts": "--uts",
            "cgroup": "--cgroup", "mnt": "--mount"}

MNTNS_FD_ENV = "CKPTD_ENTER_MNTNS_FD"

_MOVE_THEN_EXEC = (
    'for d in "$@"; do [ "$d" = -- ] && break; echo $$ > "$d/cgroup.procs" || exit 125; done; '
    'while [ "$1" != -- ]; do shift; done; shift; exec "$@"'
)
"""sh: write our pid into each cgroup directory given before ``--``, then exec the rest."""


class ContainerError(Exception):
    """A container cannot be entered (gone, or namespaces CRIU cannot be run in)."""


def ns_inodes(pid: int, kinds: Sequence[str] = (*ENTERED, *SAME_AS_NODE)) -> dict[str, int]:
    """Namespace inode numbers of ``pid`` (what ``/proc/PID/ns/KIND`` points to)."""
    return {kind: os.stat(f"/proc/{pid}/ns/{kind}").st_ino for kind in kinds}


def cgroup_dirs(pid: int) -> tuple[Path, ...]:
    """The node's directories of the cgroups ``pid`` is in, one per mounted hierarchy
    (cgroup v2's, and each v1 hierarchy's on hybrid hosts), read from ``/proc/PID/cgroup``
    and the node's mount table."""
    roots: dict[str, Path] = {}
    controllers = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()
                   if line and not line.startswith("#")}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = [*right.split(), "", "", ""][:3]
        fields = left.split()
        if fstype == "cgroup2":
            roots.setdefault("", Path(fields[4]))
        elif fstype == "cgroup":
            names = [o for o in options.split(",") if o in controllers or o.startswith("name=")]
            roots.setdefault(",".join(sorted(names)), Path(fields[4]))
    dirs: list[Path] = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, names_field, path = line.split(":", 2)
        key = ",".join(sorted(names_field.split(","))) if names_field else ""
        root = roots.get(key)
        if root is None:
            continue
        where = root / path.lstrip("/")
        if where.is_dir():
            dirs.append(where)
    return tuple(dirs)


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


@dataclass
class Container:
    """A container as its init (or any of its processes) shows it: the namespaces, pinned by
    open descriptors, and the cgroups of process ``pid`` (a node pid)."""

    pid: int
    start_time: int
    inodes: Mapping[str, int]
    cgroups: tuple[Path, ...]
    _fds: dict[str, int] = field(repr=False)
    _pidfd: int = field(repr=False)

    @classmethod
    def open(cls, pid: int) -> Container:
        """Pin the namespaces of node pid ``pid``; raises ContainerError if it is gone."""
        fds: dict[str, int] = {}
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise ContainerError(f"no process {pid} to take a container's namespaces from: "
                                 f"{exc.strerror}") from exc
        try:
            for kind in ENTERED:
                fds[kind] = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            start = _start_time(pid)
            cgroups = cgroup_dirs(pid)
            inodes = {kind: os.fstat(fd).st_ino for kind, fd in fds.items()}
            inodes.update(ns_inodes(pid, SAME_AS_NODE))
            if _exited(pidfd):
                raise ContainerError(f"process {pid} exited while its namespaces were opened")
        except (OSError, ContainerError) as exc:
            for fd in (*fds.values(), pidfd):
                os.close(fd)
            if isinstance(exc, ContainerError):
                raise
            raise ContainerError(f"cannot open the namespaces of process {pid}: {exc}") from exc
        container = cls(pid, start, inodes, cgroups, fds, pidfd)
        container.check_enterable()
        return container

    def check_enterable(self) -> None:
        """Refuse namespaces CRIU cannot be run in from here: a user namespace or time
        namespace of its own (rootless containers)."""
        mine = ns_inodes(os.getpid(), SAME_AS_NODE)
        for kind in SAME_AS_NODE:
            if self.inodes[kind] != mine[kind]:
                raise ContainerError(
                    f"process {self.pid} has a {kind} namespace of its own (a rootless "
                    "container?): CRIU is entered into pid, mount, network, ipc, uts and "
                    "cgroup namespaces only")

    def close(self) -> None:
        for fd in (*self._fds.values(), self._pidfd):
            with suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def alive(self) -> bool:
        return not _exited(self._pidfd)

    def fd(self, kind: str) -> int:
        return self._fds[kind]

    def procfs(self) -> Path:
        """The container's own /proc (pids as the container sees them), through its root."""
        return Path(f"/proc/{self.pid}/root/proc")

    def ns_pid_taken(self, ns_pid: int) -> bool:
        """Whether pid ``ns_pid`` of the container's pid namespace is in use (a process or a
        thread: CRIU's clone3 needs every pid and tid of the image free)."""
        return (self.procfs() / str(ns_pid)).exists()

    def node_pids(self) -> dict[int, int]:
        """The container's processes: its pid -> node pid."""
        found: dict[int, int] = {}
        mine = self.inodes["pid"]
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry.name}/ns/pid").st_ino != mine:
                    continue
                for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        found[int(line.split()[-1])] = int(entry.name)
            except (OSError, ValueError):
                continue
        return found

    # ---- commands run in the container -------------------------------------------------

    def command(
        self,
        argv: Sequence[str],
        *,
        preload: Path | None = None,
        enter: Sequence[str] = ENTERED,
        cgroups: bool = True,
    ) -> tuple[list[str], tuple[int, ...]]:
        """``argv`` run in this container: (the command line, the descriptors to pass).

        Moved into the container's cgroups (``cgroups``), then ``nsenter`` enters the
        namespaces in ``enter`` from our descriptors (``/proc/self/fd/N``: exactly those
        pinned) and forks, so that the command is a process of the container's pid namespace.
        With ``preload``, the mount namespace is entered by that library's constructor once
        the command is loaded from the node's file system (it need not be in the container)."""
        fds = [self._fds[kind] for kind in enter]
        nsenter = ["nsenter"]
        for kind in enter:
            if kind == "mnt" and preload is not None:
                continue
            nsenter.append(f"{_NSENTER[kind]}=/proc/self/fd/{self._fds[kind]}")
        tail = list(argv)
        if "mnt" in enter and preload is not None:
            tail = ["env", f"{MNTNS_FD_ENV}={self._fds['mnt']}", f"LD_PRELOAD={preload}", *tail]
        line = [*nsenter, "--", *tail]
        if cgroups and self.cgroups:
            line = ["sh", "-c", _MOVE_THEN_EXEC, "ckptd-enter",
                    *(str(d) for d in self.cgroups), "--", *line]
        return line, tuple(fds)

    def run(
        self,
        argv: Sequence[str],
        *,
        preload: Path | None = None,
        enter: Sequence[str] = ENTERED,
        cgroups: bool = True,
        pass_fds: Sequence[int] = (),
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        line, fds = self.command(argv, preload=preload, enter=enter, cgroups=cgroups)
        return subprocess.run(line, pass_fds=(*fds, *pass_fds), capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL,
                              start_new_session=True)

    def raise_last_pid(self, value: int) -> int:
        """Make the pid namespace hand out pids above ``value`` next, never lowering its
        counter; returns the counter after (the last pid handed out, or ``value``)."""
        v = int(value)
        script = (f"n=$(cat /proc/sys/kernel/ns_last_pid); [ \"$n\" -lt {v} ] && "
                  f"echo {v} > /proc/sys/kernel/ns_last_pid; cat /proc/sys/kernel/ns_last_pid")
        done = self.run(["sh", "-c", script], enter=("pid",), cgroups=False, timeout=30)
        if done.returncode != 0:
            raise ContainerError(f"cannot set the pid counter of the pid namespace of "
                                 f"process {self.pid}: {done.stderr.strip()}")
        return int(done.stdout.split()[-1])

    def set_last_pid(self, value: int) -> None:
        """Make the container's pid namespace hand out pids above ``value`` next (its
        ``ns_last_pid``, written by a process born in it; the node's /proc/sys is used, so a
        read-only /proc/sys in the container does not matter)."""
        done = self.run(["sh", "-c", f"echo {int(value)} > /proc/sys/kernel/ns_last_pid"],
                        enter=("pid",), cgroups=False, timeout=30)
        if done.returncode != 0:
            raise ContainerError(f"cannot set the pid counter of the pid namespace of "
                                 f"process {self.pid}: {done.stderr.strip()}")


def _exited(pidfd: int) -> bool:
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)


# ---- CRIU in a container ---------------------------------------------------------------


@dataclass(frozen=True)
class CriuResult:
    returncode: int
    seconds: float
    log: Path
    stderr: str

    def first_error(self) -> str:
        """CRIU's first error line that is not the harmless RLIMIT_NOFILE one, or ''."""
        return first_error_line(self.log, self.stderr)


@contextmanager
def _dir_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def criu_dump(
    container: Container,
    criu: str,
    images_dir: Path,
    ns_pid: int,
    *,
    preload: Path | None,
    leave_running: bool = False,
    tcp_established: bool = False,
    extra: Sequence[str] = (),
) -> CriuResult:
    """``criu dump`` of the tree whose root is pid ``ns_pid`` *of the container* (not its
    init), run inside it. Cgroups are left alone (the restore puts the tree in its new
    container's); the network lock, if connections are dumped, is nftables' in the
    container's network namespace."""
    with _dir_fd(images_dir) as dfd:
        argv = [criu, "dump", "-t", str(ns_pid), "-D", f"/proc/self/fd/{dfd}",
                "-W", f"/proc/self/fd/{dfd}", "-o", "dump.log", "-v4",
                "--manage-cgroups=ignore", "--network-lock", "nftables", "--file-locks",
                "--link-remap"]
        if leave_running:
            argv.append("--leave-running")
        if tcp_established:
            argv.append("--tcp-established")
        started = time.monotonic()
        done = container.run([*argv, *extra], preload=preload, pass_fds=(dfd,))
    return CriuResult(done.returncode, time.monotonic() - started, images_dir / "dump.log",
                      done.stderr)


def criu_restore(
    container: Container,
    criu: str,
    images_dir: Path,
    *,
    preload: Path | None,
    inherit: Mapping[str, int] = {},
    tcp_established: bool = False,
    extra: Sequence[str] = (),
) -> CriuResult:
    """``criu restore -d`` inside ``container``: the tree comes back in its namespaces,
    cgroups and root filesystem; when CRIU exits the tree's root is reparented to the
    container's init (pid 1 of its pid namespace). ``inherit``: CRIU's inherit-fd keys
    (``pipe:[ino]`` of the job's stdout at dump) -> our descriptors to put there. The
    image's pids must be free in the container (:func:`make_pids_free`)."""
    with _dir_fd(images_dir) as dfd:
        argv = [criu, "restore", "-d", "-D", f"/proc/self/fd/{dfd}",
                "-W", f"/proc/self/fd/{dfd}", "-o", "restore.log", "-v4",
                "--manage-cgroups=ignore", "--file-locks", "--link-remap",
                "--pidfile", "restore.pid"]
        if tcp_established:
            argv.append("--tcp-established")
        for key, fd in inherit.items():
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        started = time.monotonic()
        done = container.run([*argv, *extra], preload=preload,
                             pass_fds=(dfd, *inherit.values()))
    return CriuResult(done.returncode, time.monotonic() - started,
                      images_dir / "restore.log", done.stderr)


def image_pids(images_dir: Path) -> tuple[int, ...]:
    """Every pid and thread id in ``pstree.img`` (pids of the dumped container's pid
    namespace): each must be free in the container restored into."""
    raw = (images_dir / "pstree.img").read_bytes()
    if len(raw) < 8 or struct.unpack_from("<II", raw, 0) != (IMG_COMMON_MAGIC, PSTREE_MAGIC):
        raise ContainerError(f"{images_dir}/pstree.img is not a CRIU process tree image")
    ids: list[int] = []
    offset = 8
    while offset + 4 <= len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        entry = pstree_pb2.pstree_entry()
        entry.ParseFromString(raw[offset + 4: offset + 4 + size])
        offset += 4 + size
        ids += [entry.pid, *entry.threads]
    return tuple(dict.fromkeys(ids))


def make_pids_free(container: Container, pids: Sequence[int]) -> None:
    """Check that the image's pids are free in the container, then move its pid counter past
    them, so that CRIU (and anything started meanwhile) takes pids above the job's: CRIU's
    clone3(set_tid) needs each exact pid. Raises ContainerError naming a taken pid."""
    taken = [p for p in pids if container.ns_pid_taken(p)]
    if taken:
        raise ContainerError(
            f"pid {taken[0]} of the checkpoint is taken in the container of process "
            f"{container.pid} ({len(taken)} of {len(pids)} taken): start the job with its "
            "pids above those the container's own processes use (see set_last_pid)")
    container.set_last_pid(max(pids) + 1)


def stdio_pipes(node_pid: int) -> dict[int, str]:
    """Descriptors 0-2 of a process that are pipes: fd -> ``pipe:[ino]`` (CRIU's inherit-fd
    key for them)."""
    found: dict[int, str] = {}
    for fd in (0, 1, 2):
        with suppress(OSError):
            target = os.readlink(f"/proc/{node_pid}/fd/{fd}")
            if target.startswith("pipe:["):
                found[fd] = target
    return found


def open_stdio_of(node_pid: int, fds: Sequence[int]) -> dict[int, int]:
    """Our own descriptors to what ``node_pid`` has at ``fds`` (reopened through /proc: a
    pipe's or a file's), to hand to CRIU in place of the dumped job's stdio."""
    opened: dict[int, int] = {}
    for fd in fds:
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY
        opened[fd] = os.open(f"/proc/{node_pid}/fd/{fd}", flags | os.O_CLOEXEC)
    return opened
