"""The ``JobFiles`` port on Linux: which files a tree writes (/proc), their content captured
at a checkpoint and put back at a restore.

Invariants:
- content is always read through the writing process's own descriptor or mapping
  (``/proc/PID/fd/N``, ``/proc/PID/map_files/A-B``), never by path: a path swapped for a
  symlink meanwhile is never followed;
- a file is put back with the checkpoint owner's file-system identity (``setfsuid``, this
  thread only) and ``O_NOFOLLOW``: a user's restore never writes where that user could not;
- nothing on disk is lost: a version that differs from the checkpoint's is first copied beside
  the file, and ``undo`` puts it back byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from ckptd.adapters.procfs.node import fd_flags
from ckptd.adapters.procfs.rootpath import ContainerPathError, in_root, process_root, same_root
from ckptd.adapters.procfs.stdio import _as_user
from ckptd.core.ports import FileCheck, Precopy, PutBack, WrittenFile
from ckptd.domain import CapturedFile, ProcessFact
from ckptd.errors import ProcessNotFound, StoreError

PAGE = 4096
BLOCK = 1 << 20
_SKIPPED_ROOTS = ("/proc/", "/sys/", "/dev/")
_KEPT_UNDER_DEV = ("/dev/shm/",)


class ProcJobFiles:
    """``JobFiles`` over /proc and the local file systems (paths as the daemon sees them)."""

    def __init__(
        self, proc: Path = Path("/proc"), *, owner_rights: bool = True, root: Path | None = None
    ) -> None:
        self._proc = proc
        self._owner_rights = owner_rights
        self._root = root
        """Where ``check``/``put_back``/``undo`` resolve paths (None: the daemon's root)."""

    def seen_by(self, pid: int) -> ProcJobFiles:
        if not (self._proc / str(pid)).exists():
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        if same_root(self._proc, pid):
            return self
        return ProcJobFiles(self._proc, owner_rights=self._owner_rights,
                            root=process_root(self._proc, pid))

    def _rooted(self, captured: CapturedFile) -> CapturedFile:
        if self._root is None:
            return captured
        return replace(captured, path=in_root(self._root, captured.path))

    def written(self, tree: Sequence[ProcessFact]) -> tuple[WrittenFile, ...]:
        found: dict[str, WrittenFile] = {}
        overwritten: set[str] = set()  # written without O_APPEND, or mapped
        for proc in tree:
            for written, appends in self._open_for_writing(proc.pid):
                found.setdefault(written.path, written)
                if not appends:
                    overwritten.add(written.path)
            for written in self._mapped_shared_writable(proc.pid):
                found.setdefault(written.path, written)
                overwritten.add(written.path)
        return tuple(replace(found[p], append_only=p not in overwritten) for p in sorted(found))

    def precopy(self, file: WrittenFile, dest: Path) -> Precopy | None:
        return precopy_file(file, dest)

    def capture(
        self, file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        return capture_file(file, dest, precopy)

    def check(self, captured: CapturedFile, uid: int, gid: int) -> FileCheck:
        try:
            rooted = self._rooted(captured)
        except ContainerPathError as exc:
            return FileCheck(differs=True, problem=str(exc))
        with self._rights(uid, gid):
            return check_file(rooted)

    def put_back(
        self, captured: CapturedFile, content: Path, aside: str, uid: int, gid: int
    ) -> PutBack | None:
        if self._root is None:
            with self._rights(uid, gid):
                return put_back(captured, content, aside)
        with self._rights(uid, gid):  # paths in the container's root; reported as it names them
            done = put_back(self._rooted(captured), content, in_root(self._root, aside))
        return None if done is None else PutBack(captured.path, aside if done.aside else "")

    def undo(self, done: PutBack, uid: int, gid: int) -> None:
        if self._root is not None:
            done = PutBack(in_root(self._root, done.path),
                           in_root(self._root, done.aside) if done.aside else "")
        with self._rights(uid, gid):
            undo_put_back(done)

    # ---- internals ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rights(self, uid: int, gid: int) -> Iterator[None]:
        if self._owner_rights and uid != 0:
            with _as_user(uid, gid):
                yield
        else:
            yield

    def _open_for_writing(self, pid: int) -> Iterator[tuple[WrittenFile, bool]]:
        """Each regular file open for writing, and whether that descriptor appends."""
        fd_dir = self._proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            return
        for name in fds:
            try:
                target = os.readlink(fd_dir / name)
                flags = fd_flags(self._proc / str(pid) / "fdinfo" / name)
                if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
                    continue
                if not _capturable(target):
                    continue
                st = os.stat(fd_dir / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield (WrittenFile(target, st.st_size, str(fd_dir / name), pid),
                       bool(flags & os.O_APPEND))

    def _mapped_shared_writable(self, pid: int) -> Iterator[WrittenFile]:
        base = self._proc / str(pid)
        try:
            lines = (base / "maps").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[1][1] != "w" or parts[1][3] != "s":
                continue
            path = parts[5]
            if not _capturable(path):
                continue
            source = base / "map_files" / parts[0]
            try:
                st = os.stat(source)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield WrittenFile(path, st.st_size, str(source), pid)


def _capturable(path: str) -> bool:
    """A path of a file system file (not deleted: CRIU keeps those itself; not /proc, /sys
    or devices, but POSIX shared memory under /dev/shm)."""
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return False
    return path.startswith(_KEPT_UNDER_DEV) or not path.startswith(_SKIPPED_ROOTS)


@dataclass
class _Copied:
    """A precopy's state: which file it was, and the hash of what was copied."""

    dev: int
    ino: int
    digest: Any


def precopy_file(file: WrittenFile, dest: Path) -> Precopy | None:
    """What ``file`` holds now, copied to ``dest`` (no padding yet)."""
    try:
        src = os.open(file.source, os.O_RDONLY)
    except OSError:
        return None
    digest = xxhash.xxh3_128()
    try:
        st = os.fstat(src)
        with open(dest, "wb") as out:
            size = _copy_from(src, 0, out, digest)
    finally:
        os.close(src)
    return Precopy(file.path, size, _Copied(st.st_dev, st.st_ino, digest))


def capture_file(
    file: WrittenFile, dest: Path, precopy: Precopy | None = None
) -> CapturedFile | None:
    """Copy ``file``'s content (read through ``file.source``) to ``dest``, zero-padded to whole
    pages (zero pages cost nothing in the store); None when it is gone. After a ``precopy``
    into ``dest`` of the same file, not shorter now: only the bytes appended since."""
    try:
        src = os.open(file.source, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(src)
        early = precopy.state if precopy is not None else None
        if (isinstance(early, _Copied) and precopy is not None and (early.dev, early.ino) == (
                st.st_dev, st.st_ino) and st.st_size >= precopy.size):
            digest = early.digest.copy()
            with open(dest, "r+b") as out:
                out.seek(precopy.size)
                size = precopy.size + _copy_from(src, precopy.size, out, digest)
                out.truncate(-(-size // PAGE) * PAGE)
        else:
            digest = xxhash.xxh3_128()
            with open(dest, "wb") as out:
                size = _copy_from(src, 0, out, digest)
                out.truncate(-(-size // PAGE) * PAGE)
    finally:
        os.close(src)
    return CapturedFile(
        path=file.path, size=size, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid,
        gid=st.st_gid, hash=digest.hexdigest(), image=dest.name,
    )


def _copy_from(src: int, offset: int, out: BinaryIO, digest: Any) -> int:
    """Copy ``src`` from ``offset`` to its end into ``out`` (at its position); bytes copied."""
    copied = 0
    while chunk := os.pread(src, BLOCK, offset + copied):
        digest.update(chunk)
        out.write(chunk)
        copied += len(chunk)
    return copied


def check_file(captured: CapturedFile) -> FileCheck:
    """Whether ``captured`` can be put back at its path, and whether what is there differs."""
    parent = os.path.dirname(captured.path)
    try:
        st = os.lstat(captured.path)
    except FileNotFoundError:
        if not os.path.isdir(parent):
            return FileCheck(differs=True, problem=f"its directory {parent} is missing")
        return FileCheck(differs=True)
    except OSError as exc:
        return FileCheck(differs=True, problem=f"it cannot be examined ({exc.strerror})")
    if not stat.S_ISREG(st.st_mode):
        return FileCheck(differs=True, problem="it is no longer a regular file")
    try:
        fd = os.open(captured.path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return FileCheck(differs=True, problem=f"it cannot be opened ({exc.strerror})")
    try:
        differs = st.st_size != captured.size or _hash_fd(fd) != captured.hash
    finally:
        os.close(fd)
    if differs:
        try:  # with this thread's file-system identity (access() would ask for root's)
            os.close(os.open(captured.path, os.O_WRONLY | os.O_NOFOLLOW))
        except OSError as exc:
            return FileCheck(differs=True, problem=f"it is not writable ({exc.strerror})")
    return FileCheck(differs=differs)


def put_back(captured: CapturedFile, content: Path, aside: str) -> PutBack | None:
    """Make ``captured.path`` hold the first ``captured.size`` bytes of ``content``; a version
    on disk that differs is first copied to ``aside``. None when it already held them."""
    created = False
    try:
        fd = os.open(captured.path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = os.open(captured.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL,
                     captured.mode)
        created = True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"cannot put back {captured.path}: not a regular file")
        if not created and _same(fd, captured, content):
            return None
        if not created:
            _copy_fd_to_new(fd, aside, captured.mode)
        try:
            _write_differing(fd, content, captured.size)
        except BaseException:
            if not created:
                _copy_path_into_fd(aside, fd)
                os.unlink(aside)
            raise
    finally:
        os.close(fd)
    if created:
        with contextlib.suppress(OSError):
            os.chown(captured.path, captured.uid, captured.gid)
    return PutBack(path=captured.path, aside="" if created else aside)


def undo_put_back(done: PutBack) -> None:
    """The file as it was before ``put_back``: removed if it was created, else the version
    kept aside copied back (and the copy removed)."""
    if not done.aside:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(done.path)
        return
    fd = os.open(done.path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        _copy_path_into_fd(done.aside, fd)
    finally:
        os.close(fd)
    os.unlink(done.aside)


def _hash_fd(fd: int) -> str:
    digest = xxhash.xxh3_128()
    offset = 0
    while chunk := os.pread(fd, BLOCK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _same(fd: int, captured: CapturedFile, content: Path) -> bool:
    return os.fstat(fd).st_size == captured.size and _hash_fd(fd) == captured.hash


def _write_differing(fd: int, content: Path, size: int) -> None:
    """Blocks of ``fd`` that differ from ``content`` are rewritten; then truncated to
    ``size`` and made durable (an appended log costs only its truncation)."""
    with open(content, "rb") as src:
        offset = 0
        while offset < size:
            want = src.read(min(BLOCK, size - offset))
            if not want:
                raise StoreError(f"captured content {content} is shorter than {size} bytes")
            if os.pread(fd, len(want), offset) != want:
                os.pwrite(fd, want, offset)
            offset += len(want)
    os.ftruncate(fd, size)
    os.fsync(fd)


def _copy_fd_to_new(fd: int, dest: str, mode: int) -> None:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        offset = 0
        while chunk := os.pread(fd, BLOCK, offset):
            os.write(out, chunk)
            offset += len(chunk)
        os.fsync(out)
    finally:
        os.close(out)


def _copy_path_into_fd(src_path: str, fd: int) -> None:
    src = os.open(src_path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        offset = 0
        while chunk := os.pread(src, BLOCK, offset):
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(src)
