"""Root's file operations on paths that users and containers control, reached fd-relative.

ckptd writes, creates, chowns and removes files as root at paths that a user (owning a
directory on the way) or a container (owning its whole file system) can change between a
check and a use. Every such path is therefore resolved from a pinned directory fd — the
node's root, or a container's root opened once from ``/proc/PID/root`` — one component at a
time with openat2(2) and ``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` plus
``RESOLVE_BENEATH`` (``RESOLVE_IN_ROOT`` in a container):

- a symbolic link anywhere on the way (a directory swapped for one included) is refused
  (``UnsafePath``), never followed; ``..`` and ``.`` components are refused;
- the directory a file lives in is held as an fd (``Located.dirfd``): the file is then opened,
  created (``O_EXCL``), renamed and removed relative to it, and changed through its own fd
  (``fchown``, ``fchmod``, ``fstat``), never by path;
- the owner and identity of every directory on the way are read from those fds
  (``Located.chain``), so that a restore can refuse a chain that changed since the dump.

Where the kernel lacks openat2 (before Linux 5.6) every operation is refused
(``UnsafePath``), never done by path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
SYS_OPENAT2 = 437
"""openat2's number: the same on every architecture ckptd runs on (the unified table)."""
RENAME_NOREPLACE = 1
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}.get(os.uname().machine, 0)

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


class UnsafePath(OSError):
    """A path root will not act on: a link on the way, '..', a hard-linked file, a
    directory that changed since the checkpoint, or a kernel without openat2."""


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64))


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): ``path`` opened relative to ``dirfd`` under the ``resolve`` rules
    (close-on-exec always). Raises OSError (ELOOP for a refused link, ENOSYS without it)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    fd = _LIBC.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def rename_noreplace(dirfd: int, old: str, new: str) -> None:
    """renameat2(RENAME_NOREPLACE) within ``dirfd``: EEXIST rather than replace ``new``."""
    if not SYS_RENAMEAT2:
        raise UnsafePath(errno.ENOSYS, f"renameat2 is not known on {os.uname().machine}")
    rc = _LIBC.syscall(ctypes.c_long(SYS_RENAMEAT2), ctypes.c_int(dirfd),
                       ctypes.c_char_p(os.fsencode(old)), ctypes.c_int(dirfd),
                       ctypes.c_char_p(os.fsencode(new)), ctypes.c_uint(RENAME_NOREPLACE))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), new)


DirFact = tuple[int, int, int]
"""A directory on a file's path as seen at a checkpoint: (owner uid, st_dev, st_ino)."""


@dataclass(frozen=True)
class Located:
    """A file's directory held open, its name in it, and every directory from the root down
    to it (``chain[0]`` is the root, ``chain[-1]`` the file's directory)."""

    dirfd: int
    name: str
    chain: tuple[DirFact, ...]
    path: str


def components(path: str) -> list[str]:
    """The components of an absolute ``path``; raises UnsafePath for '..' or '.'."""
    if not path.startswith("/"):
        raise UnsafePath(errno.EINVAL, f"{path!r} is not an absolute path")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UnsafePath(errno.EINVAL, f"{path!r} has a '.' or '..' component")
    if not parts:
        raise UnsafePath(errno.EINVAL, f"{path!r} names no file")
    return parts


class Root:
    """A directory fd paths are resolved from: the node's ``/`` or a container's root.

    Invariant: the fd is opened once and every resolution starts from it, so a root that a
    container swaps later (or a pid that is reused) never changes where ckptd writes."""

    def __init__(self, fd: int, resolve: int, label: str) -> None:
        self.fd = fd
        self.resolve = resolve | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
        self.label = label

    @classmethod
    def node(cls) -> Root:
        return cls(_open_root("/"), RESOLVE_BENEATH, "")

    @classmethod
    def of_directory(cls, path: Path, label: str) -> Root:
        """A root at ``path`` (``/proc/PID/root`` for a container: opened now, pinned)."""
        return cls(_open_root(str(path)), RESOLVE_IN_ROOT, label)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def _step(self, dirfd: int, name: str, flags: int, mode: int = 0) -> int:
        try:
            return openat2(dirfd, name, flags, mode, self.resolve)
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                raise UnsafePath(errno.ENOSYS, "this kernel has no openat2 (Linux 5.6 or "
                                 "later): ckptd does not act on files by path as root") from exc
            raise

    @contextmanager
    def locate(self, path: str) -> Iterator[Located]:
        """``path``'s directory held open (O_PATH), reached with no link followed, and the
        facts of every directory on the way. Raises UnsafePath for a link, FileNotFoundError
        for a missing directory (its ``filename`` says which), NotADirectoryError."""
        parts = components(path)
        fd = self._step(self.fd, ".", os.O_PATH | os.O_DIRECTORY)
        chain = [_fact(fd)]
        try:
            for i, part in enumerate(parts[:-1]):
                where = "/" + "/".join(parts[: i + 1])
                try:
                    nfd = self._step(fd, part, os.O_PATH | os.O_DIRECTORY)  # ELOOP: a link
                except OSError as exc:
                    raise _explained(exc, where, path, self.label) from exc
                os.close(fd)
                fd = nfd
                chain.append(_fact(fd))
            yield Located(fd, parts[-1], tuple(chain), path)
        finally:
            os.close(fd)

    def open_in(self, loc: Located, flags: int, mode: int = 0, name: str = "") -> int:
        """A file in ``loc``'s directory (``loc.name`` unless ``name``), never through a
        link; raises UnsafePath when it is one."""
        target = name or loc.name
        try:
            return self._step(loc.dirfd, target, flags | os.O_NOFOLLOW, mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(errno.ELOOP, f"{self.label}{_join(loc, target)} is a symbolic "
                                 "link: ckptd does not follow links as root") from exc
            raise


def _join(loc: Located, name: str) -> str:
    return loc.path.rsplit("/", 1)[0] + "/" + name


def _open_root(path: str) -> int:
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:  # probe once: without openat2 nothing is done at all
        os.close(openat2(fd, ".", os.O_PATH | os.O_DIRECTORY, 0, RESOLVE_BENEATH))
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.ENOSYS:
            raise UnsafePath(errno.ENOSYS, "this kernel has no openat2 (Linux 5.6 or later): "
                             "ckptd does not act on files by path as root") from exc
        raise
    return fd


def _fact(fd: int) -> DirFact:
    st = os.fstat(fd)
    return (st.st_uid, st.st_dev, st.st_ino)


def _explained(exc: OSError, where: str, path: str, label: str) -> OSError:
    if exc.errno == errno.ELOOP:
        return UnsafePath(errno.ELOOP, f"{label}{where} is a symbolic link (on the way to "
                          f"{path}): ckptd does not follow links as root")
    if exc.errno == errno.EXDEV:
        return UnsafePath(errno.EXDEV, f"{label}{where} leaves the container's root")
    if exc.errno == errno.ENOENT:
        return FileNotFoundError(errno.ENOENT, f"its directory {where} is missing", where)
    if exc.errno == errno.ENOTDIR:
        return NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory", where)
    return OSError(exc.errno, f"{where}: {exc.strerror}", where)


def chain_problem(path: str, then: tuple[DirFact, ...], now: tuple[DirFact, ...],
                  same_boot: bool) -> str:
    """Why the directories on ``path`` are not those of the checkpoint ("" when they are):
    another owner anywhere, or (on the same boot of the node, in the same root) another
    directory. In another root (the next container of a job: a new root file system) or
    after a reboot identities differ by nature, so only owners are compared there."""
    if not then:
        return ""  # a checkpoint from before chains were recorded: links are still refused
    same_boot = same_boot and bool(now) and then[0][1:] == now[0][1:]
    parts = components(path)[:-1]
    names = ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    if len(then) != len(now):
        return f"its directory chain changed since the checkpoint ({len(then)} levels then)"
    for name, (uid_then, dev_then, ino_then), (uid_now, dev_now, ino_now) in zip(
            names, then, now, strict=True):
        if uid_then != uid_now:
            return (f"directory {name} is now owned by uid {uid_now} (uid {uid_then} at the "
                    "checkpoint)")
        if same_boot and (dev_then, ino_then) != (dev_now, ino_now):
            return (f"directory {name} was replaced since the checkpoint (it is not the "
                    "directory the job wrote into)")
    return ""


def regular_single(st: os.stat_result, what: str) -> str:
    """Why a file found at a path is not one root may write ("" when it is)."""
    if not stat.S_ISREG(st.st_mode):
        return f"{what} is no longer a regular file"
    if st.st_nlink > 1:
        return (f"{what} has {st.st_nlink} hard links: ckptd does not write through a "
                "hard link as root")
    return ""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
