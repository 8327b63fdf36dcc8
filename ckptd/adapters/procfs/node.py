"""``NodeInspector`` over /proc and the file system: CPU, kernel, libc, and the files a tree uses.

Cheap by design: each path is stat'ed once (deduplicated across processes), and only regular
files of at most ``HASH_LIMIT`` bytes are read to hash them (xxh3-128).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import xxhash

from ckptd.adapters.procfs.rootpath import in_root, process_root, same_root
from ckptd.adapters.procfs.tcp import has_address
from ckptd.domain import HASH_LIMIT, FileKind, FileNeed, NodeFingerprint, ProcessFact
from ckptd.errors import ProcessNotFound

_PSEUDO = ("/proc/", "/sys/", "/dev/")
_PRIORITY = {FileKind.EXE: 0, FileKind.MAP: 1, FileKind.FILE: 2, FileKind.CWD: 3}


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """CPU model and feature flags of the first CPU in /proc/cpuinfo (x86 ``model name`` /
    ``flags``; arm64 ``CPU part`` / ``Features``)."""
    model = ""
    flags: tuple[str, ...] = ()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key == "CPU part" and not model:
            model = f"CPU part {value.strip()}"
        elif key in ("flags", "Features") and not flags:
            flags = tuple(sorted(set(value.split())))
    return model, flags


def parse_maps(text: str) -> list[tuple[str, bool]]:
    """``(path, shared writable)`` of each file-backed mapping of /proc/PID/maps (no pseudo
    or deleted files). A shared writable mapping writes to its file: expected to change."""
    paths: list[tuple[str, bool]] = []
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5]
        if not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        if path.startswith(("/dev/", "/memfd:", "/SYSV")):
            continue
        perms = fields[1]
        paths.append((path, perms[1:2] == "w" and perms[3:4] == "s"))
    return paths


def parse_mount_points(text: str) -> list[str]:
    """Mount points of /proc/PID/mountinfo (octal escapes decoded)."""
    points = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.append(_unescape(fields[4]))
    return points


def _unescape(text: str) -> str:
    return text.encode().decode("unicode_escape") if "\\" in text else text


def fd_flags(fdinfo: Path) -> int:
    """The open flags /proc/PID/fdinfo/FD shows (0 when unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        for line in fdinfo.read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    return 0


def file_hash(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            h.update(chunk)
    return h.hexdigest()


class ProcNodeInspector:
    """``NodeInspector`` over /proc. ``root``/``mountinfo``: the file system and mount table
    paths are resolved in (the daemon's by default; a container's for ``seen_by``);
    ``netns``: the network namespace addresses are looked for in (None: the daemon's)."""

    def __init__(
        self, proc: Path = Path("/proc"), *, root: Path | None = None,
        mountinfo: Path | None = None, netns: Path | None = None,
    ) -> None:
        self._proc = proc
        self._root = root
        self._mountinfo = mountinfo or proc / "self" / "mountinfo"
        self._netns = netns

    def has_address(self, address: str) -> bool:
        return has_address(address, self._netns)

    def seen_by(self, pid: int) -> ProcNodeInspector:
        if not (self._proc / str(pid)).exists():
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        netns = self._proc / str(pid) / "ns" / "net"
        try:
            own_net = os.stat(netns).st_ino == os.stat(self._proc / "self" / "ns" / "net").st_ino
        except OSError:
            own_net = True
        other_net = None if own_net else netns
        if same_root(self._proc, pid):
            if other_net is None:
                return self
            return ProcNodeInspector(self._proc, netns=other_net)
        return ProcNodeInspector(self._proc, root=process_root(self._proc, pid),
                                 mountinfo=self._proc / str(pid) / "mountinfo", netns=other_net)

    def here(self) -> NodeFingerprint:
        uname = os.uname()
        try:
            model, flags = parse_cpuinfo((self._proc / "cpuinfo").read_text())
        except OSError:
            model, flags = "", ()
        libc = ""
        with contextlib.suppress(ValueError, OSError):
            libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
        return NodeFingerprint(
            arch=uname.machine, cpu_model=model, cpu_flags=flags, kernel=uname.release, libc=libc
        )

    def fingerprint(self, tree: Sequence[ProcessFact]) -> NodeFingerprint:
        """Paths as the tree's root process sees them (a container's root file system and
        mounts when it is in one), so that a restore checks them in the same place."""
        if tree and self._root is None:
            try:
                view = self.seen_by(tree[0].pid)
            except ProcessNotFound:
                view = self
            if view is not self:
                return view.fingerprint(tree)
        wanted: dict[str, FileKind] = {}
        writable: set[str] = set()
        sized: set[str] = set()  # opened without O_APPEND, or mapped: CRIU checks the size

        def want(path: str, kind: FileKind) -> None:
            if path.startswith(_PSEUDO):
                return
            old = wanted.get(path)
            if old is None or _PRIORITY[kind] < _PRIORITY[old]:
                wanted[path] = kind

        for proc in tree:
            base = self._proc / str(proc.pid)
            with contextlib.suppress(OSError):
                want(os.readlink(base / "exe"), FileKind.EXE)
            with contextlib.suppress(OSError):
                for path, shared_writable in parse_maps((base / "maps").read_text()):
                    want(path, FileKind.MAP)
                    sized.add(path)
                    if shared_writable:
                        writable.add(path)
            with contextlib.suppress(OSError):
                want(os.readlink(base / "cwd"), FileKind.CWD)
            with contextlib.suppress(OSError):
                for fd in os.listdir(base / "fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(base / "fd" / fd)
                        if target.startswith("/") and not target.endswith(" (deleted)") and (
                            stat.S_ISREG(os.stat(base / "fd" / fd).st_mode)
                        ):
                            want(target, FileKind.FILE)
                            flags = fd_flags(base / "fdinfo" / fd)
                            if flags & os.O_ACCMODE != os.O_RDONLY:
                                writable.add(target)
                            if not flags & os.O_APPEND:
                                sized.add(target)
        files: list[FileNeed] = []
        for path, kind in sorted(wanted.items()):
            written = kind in (FileKind.MAP, FileKind.FILE) and path in writable
            need = self.file(path, kind, not written)
            if need is not None:
                if written:
                    need = replace(need, writable=True, append_only=path not in sized)
                files.append(need)
        mounts = self._mount_points()
        used = sorted({_mount_of(f.path, mounts) for f in files})
        files.extend(FileNeed(m, FileKind.MOUNT) for m in used)
        node = self.here()
        return NodeFingerprint(
            arch=node.arch, cpu_model=node.cpu_model, cpu_flags=node.cpu_flags,
            kernel=node.kernel, libc=node.libc, files=tuple(files),
        )

    def file(self, path: str, kind: FileKind, with_hash: bool) -> FileNeed | None:
        if kind is FileKind.MOUNT:
            return FileNeed(path, kind) if path in self._mount_points() else None
        where = path
        try:
            if self._root is not None:
                where = in_root(self._root, path)
            st = os.stat(where)
        except OSError:
            return None
        if kind is FileKind.CWD:
            return FileNeed(path, kind) if stat.S_ISDIR(st.st_mode) else None
        if not stat.S_ISREG(st.st_mode):
            return None
        digest = ""
        if with_hash and st.st_size <= HASH_LIMIT:
            with contextlib.suppress(OSError):
                digest = file_hash(where)
        return FileNeed(path, kind, size=st.st_size, mtime_ns=st.st_mtime_ns, hash=digest)

    def _mount_points(self) -> set[str]:
        try:
            return set(parse_mount_points(self._mountinfo.read_text()))
        except OSError:
            return {"/"}


def _mount_of(path: str, mounts: set[str]) -> str:
    """The mount point ``path`` lives on: its longest prefix among ``mounts``."""
    best = "/"
    for m in mounts:
        if (path == m or path.startswith(m.rstrip("/") + "/")) and len(m) > len(best):
            best = m
    return best
