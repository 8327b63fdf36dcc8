"""A captured file checked against what is at its path, put back, and the put-back undone —
as root, on paths users and containers control, so every step is fd-relative (``safefs``).

Invariants:
- the file's directory is reached from a pinned root with no link followed and held as an
  fd; the file is opened, created (``O_EXCL``), renamed and removed relative to it; owner,
  mode and identity are set and read through the file's own fd;
- refused (``UnsafePath``, listed by ``check``): a link anywhere on the way, a file with more
  than one hard link, a file now owned by another uid than at the checkpoint, a directory on
  the way owned by another uid than at the checkpoint, or (same boot of the node) another
  directory than the one the job wrote into;
- a version found that differs is first copied *aside*: mode 0600, owned by the file's
  owner, written under ``<aside>.part`` and renamed to ``<aside>`` only when complete and
  durable; a missing file is written under ``<aside>.new`` and renamed into place
  (``RENAME_NOREPLACE``) when complete;
- ``before(done)`` is called before each effect exists, with what undoes it (the caller
  journals it): ``undo_put_back`` then works from any point a crash left — a ``.part`` or
  ``.new`` temporary is removed, a complete aside is copied back (only into the very file,
  by ``(st_dev, st_ino)``), a created file is removed (only the very file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from ckptd.adapters.procfs.filecopy import BLOCK, copy_range, hash_fd
from ckptd.adapters.procfs.safefs import (
    Located,
    Root,
    UnsafePath,
    boot_id,
    chain_problem,
    regular_single,
    rename_noreplace,
)
from ckptd.core.ports import FileCheck, PutBack
from ckptd.domain import CapturedFile
from ckptd.errors import StoreError

PART = ".part"
NEW = ".new"


def _chain_check(loc: Located, captured: CapturedFile) -> str:
    same_boot = bool(captured.boot) and captured.boot == boot_id()
    return chain_problem(captured.path, captured.dirs, loc.chain, same_boot)


def _file_problem(st: os.stat_result, captured: CapturedFile) -> str:
    problem = regular_single(st, "it")
    if not problem and captured.dirs and st.st_uid != captured.uid:
        problem = (f"it is now owned by uid {st.st_uid} (uid {captured.uid} at the "
                   "checkpoint): move it away to have it put back")
    return problem


def check_file(root: Root, captured: CapturedFile) -> FileCheck:
    """Whether ``captured`` can be put back at its path, and whether what is there differs."""
    try:
        with root.locate(captured.path) as loc:
            problem = _chain_check(loc, captured)
            if problem:
                return FileCheck(differs=True, problem=problem)
            try:
                probe = root.open_in(loc, os.O_PATH)
            except FileNotFoundError:
                return FileCheck(differs=True)
            try:
                st = os.fstat(probe)
            finally:
                os.close(probe)
            problem = _file_problem(st, captured)
            if problem:
                return FileCheck(differs=True, problem=problem)
            fd = root.open_in(loc, os.O_RDONLY | os.O_NONBLOCK)
            try:
                now = os.fstat(fd)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    return FileCheck(differs=True, problem="it changed while examined")
                differs = (now.st_size != captured.size
                           or stat.S_IMODE(now.st_mode) != captured.mode & 0o7777
                           or hash_fd(fd, now.st_size) != captured.hash)
            finally:
                os.close(fd)
            if differs:
                try:  # with this thread's file-system identity (access() would ask root's)
                    os.close(root.open_in(loc, os.O_WRONLY | os.O_NONBLOCK))
                except OSError as exc:
                    return FileCheck(differs=True,
                                     problem=f"it is not writable ({exc.strerror})")
            return FileCheck(differs=differs)
    except UnsafePath as exc:
        return FileCheck(differs=True, problem=str(exc.strerror or exc))
    except FileNotFoundError as exc:
        return FileCheck(differs=True, problem=str(exc.strerror or exc))
    except OSError as exc:
        return FileCheck(differs=True, problem=f"it cannot be examined ({exc.strerror})")


def put_back(
    root: Root, captured: CapturedFile, content: Path, aside: str,
    before: Callable[[PutBack], None],
) -> PutBack | None:
    """Make ``captured.path`` hold the first ``captured.size`` bytes of ``content``; a
    version there that differs is first copied to ``aside`` (same directory). None when it
    already held them. On failure the file is as it was. Raises UnsafePath when refused."""
    aside_name = _name_in_same_dir(captured.path, aside)
    with root.locate(captured.path) as loc:
        problem = _chain_check(loc, captured)
        if problem:
            raise UnsafePath(errno.EPERM, f"cannot put back {captured.path}: {problem}")
        try:
            fd = root.open_in(loc, os.O_RDWR | os.O_NONBLOCK)
        except FileNotFoundError:
            return _create(root, loc, captured, content, aside, aside_name + NEW, before)
        try:
            st = os.fstat(fd)
            problem = _file_problem(st, captured)
            if problem:
                raise UnsafePath(errno.EPERM, f"cannot put back {captured.path}: {problem}")
            found_mode = stat.S_IMODE(st.st_mode)
            want_mode = captured.mode & 0o7777
            if st.st_size == captured.size and hash_fd(fd, st.st_size) == captured.hash:
                if found_mode == want_mode:
                    return None
                done = PutBack(path=captured.path, aside="", dev=st.st_dev, ino=st.st_ino,
                               mode=found_mode)  # CRIU insists on the mode at dump too
                before(done)
                os.fchmod(fd, want_mode)
                return done
            done = PutBack(path=captured.path, aside=aside, dev=st.st_dev, ino=st.st_ino,
                           temp=aside + PART, mode=found_mode)
            before(done)
            _write_aside(root, loc, fd, st, aside_name)
            try:
                _write_differing(fd, content, captured.size)
                os.fchmod(fd, want_mode)
            except BaseException:
                _copy_aside_back(root, loc, fd, aside_name)
                os.fchmod(fd, found_mode)
                raise
            return done
        finally:
            os.close(fd)


def _create(
    root: Root, loc: Located, captured: CapturedFile, content: Path, aside: str,
    temp_name: str, before: Callable[[PutBack], None],
) -> PutBack:
    """A missing file: written complete under ``temp_name``, then renamed into place."""
    temp = aside + NEW
    before(PutBack(path=captured.path, aside="", created=True, temp=temp))
    fd = root.open_in(loc, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, name=temp_name)
    try:
        try:
            with contextlib.suppress(OSError):  # as the owner (setfsuid) it is theirs already
                os.fchown(fd, captured.uid, captured.gid)
            _write_fresh(fd, content, captured.size)
            os.fchmod(fd, captured.mode & 0o7777)
            st = os.fstat(fd)
            done = PutBack(path=captured.path, aside="", created=True, dev=st.st_dev,
                           ino=st.st_ino, temp=temp)
            before(done)
            rename_noreplace(loc.dirfd, temp_name, loc.name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp_name, dir_fd=loc.dirfd)
            raise
    finally:
        os.close(fd)
    return done


def undo_put_back(root: Root, done: PutBack) -> None:
    """The file as ``put_back`` found it, from whatever point it reached: its temporary
    removed, a complete aside copied back into the very file and removed, a created file
    removed. Acts only on the files ``done`` identifies; safe to run twice."""
    with root.locate(done.path) as loc:
        if done.temp:
            _unlink_if_present(loc, _name_in_same_dir(done.path, done.temp))
        if done.created:
            if done.ino and _identity(loc, loc.name) == (done.dev, done.ino):
                os.unlink(loc.name, dir_fd=loc.dirfd)
            return
        aside_name = _name_in_same_dir(done.path, done.aside) if done.aside else ""
        if aside_name and _identity(loc, aside_name) is None:
            aside_name = ""  # the aside never completed: the content was not touched
        if not aside_name and not done.mode:
            return
        fd = root.open_in(loc, os.O_RDWR | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (done.dev, done.ino):
                raise UnsafePath(errno.ESTALE, f"{done.path} is another file than the one put "
                                 f"back" + (f"; the version found is kept as {done.aside}"
                                            if aside_name else ""))
            if aside_name:
                _copy_aside_back(root, loc, fd, aside_name)
            if done.mode:
                os.fchmod(fd, done.mode)
        finally:
            os.close(fd)


# ---- internals ------------------------------------------------------------------------------


def _name_in_same_dir(path: str, other: str) -> str:
    head, _, name = other.rpartition("/")
    if head != path.rpartition("/")[0] or not name:
        raise UnsafePath(errno.EINVAL, f"{other} is not beside {path}")
    return name


def _identity(loc: Located, name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(name, dir_fd=loc.dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else (-1, -1)


def _unlink_if_present(loc: Located, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=loc.dirfd)


def _write_aside(root: Root, loc: Located, fd: int, st: os.stat_result, name: str) -> None:
    """A copy of ``fd`` as ``name`` beside it: 0600, the file's owner's, complete and
    durable before it gets its name."""
    part = name + PART
    out = root.open_in(loc, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, name=part)
    try:
        try:
            with contextlib.suppress(OSError):  # as the owner (setfsuid) it is theirs already
                os.fchown(out, st.st_uid, st.st_gid)
            os.fchmod(out, 0o600)
            os.ftruncate(out, st.st_size)
            copy_range(fd, 0, st.st_size, out, _NoDigest())
            os.fsync(out)
            rename_noreplace(loc.dirfd, part, name)
        except BaseException:
            _unlink_if_present(loc, part)
            raise
    finally:
        os.close(out)


def _copy_aside_back(root: Root, loc: Located, fd: int, name: str) -> None:
    src = root.open_in(loc, os.O_RDONLY | os.O_NONBLOCK, name=name)
    try:
        size = os.fstat(src).st_size
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
        copy_range(src, 0, size, fd, _NoDigest())
        os.fsync(fd)
    finally:
        os.close(src)
    os.unlink(name, dir_fd=loc.dirfd)


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


def _write_fresh(fd: int, content: Path, size: int) -> None:
    """A new file (empty): ``content``'s data extents only, holes left holes; durable."""
    src = os.open(content, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(src).st_size < size:
            raise StoreError(f"captured content {content} is shorter than {size} bytes")
        os.ftruncate(fd, size)
        copy_range(src, 0, size, fd, _NoDigest())
    finally:
        os.close(src)
    os.fsync(fd)


class _NoDigest:
    def update(self, chunk: bytes) -> None:
        pass
