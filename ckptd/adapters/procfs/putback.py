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
  by ``(st_dev, st_ino)``), a created file is removed (only the very file);
- a log rotated since the checkpoint (same boot, same directory): the file the job had open
  (its recorded identity), found under another name of its rotated set and still starting
  with the checkpoint's content, leaves the set (renamed ``<its name>.ckptd-<id>``), as do
  files of the set not there at the checkpoint and written after it; the set's other files
  get their names of the checkpoint back (``follow_rotation``). Only renames, each journaled
  (``PutBack.moved_from``) and undone by renaming back the very file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import replace
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
        follow_rotation(root, loc, captured, aside[len(captured.path):], before)
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
            made = _write_aside(root, loc, fd, st, aside_name)
            try:
                _write_differing(fd, content, captured.size)
                os.fchmod(fd, want_mode)
            except BaseException:
                _copy_aside_back(root, loc, fd, aside_name)
                os.fchmod(fd, found_mode)
                raise
            return replace(done, aside_ino=made.st_ino, aside_uid=made.st_uid)
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
    removed; a file renamed by ``follow_rotation`` renamed back. Acts only on the files
    ``done`` identifies; safe to run twice."""
    if done.moved_from:
        with root.locate(done.path) as loc:
            old = _name_in_same_dir(done.path, done.moved_from)
            if _identity(loc, loc.name) == (done.dev, done.ino):
                try:
                    rename_noreplace(loc.dirfd, loc.name, old)
                except FileExistsError as exc:
                    raise UnsafePath(errno.EEXIST, f"cannot rename {done.path} back to "
                                     f"{done.moved_from}: that name is taken") from exc
        return
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


def rotated_set(root: Root, loc: Located) -> dict[str, os.stat_result]:
    """The regular files beside ``loc.name`` named ``<name>.<anything>`` (``job.log.1``,
    ``job.log.2.gz``): its rotated set; asides and temporaries left out. fd-relative."""
    return {name: st for name, st in entries(root, loc).items()
            if _in_set(loc.name, name) and stat.S_ISREG(st.st_mode)}


def follow_rotation(
    root: Root, loc: Located, captured: CapturedFile, suffix: str,
    before: Callable[[PutBack], None],
) -> None:
    """Where a log rotated since the checkpoint, its rotated set made as at the checkpoint,
    so that no step is in it twice once the checkpoint's content is back at the path.

    Acts only on the same boot, in the directory the job wrote into, when the file open at
    the checkpoint (``captured.dev``/``ino``) is no longer at the path but under a name of
    its rotated set, and still starts with the checkpoint's content (it was appended to, then
    renamed). Then, by renames only (``RENAME_NOREPLACE``, ``before`` called first): that
    file leaves the set (``<its name><suffix>``: its steps up to the checkpoint go back at
    the path, the restored job writes the others again); so does each file of the set not
    there at the checkpoint and written after it (``captured.at_ns``); each file the set held
    at the checkpoint gets its name of then back where that name is free. Files are touched
    only when regular, single-linked and the checkpoint owner's."""
    same_boot = bool(captured.boot) and captured.boot == boot_id()
    if not (captured.ino and same_boot and captured.dirs
            and captured.dirs[-1][1:] == loc.chain[-1][1:]):
        return
    ident = (captured.dev, captured.ino)
    if _identity(loc, loc.name) == ident:
        return
    listing = entries(root, loc)
    family = {n: st for n, st in listing.items()
              if _in_set(loc.name, n) and _ours(st, captured)}
    where = {(st.st_dev, st.st_ino): n for n, st in family.items()}
    moved = where.get(ident)
    if moved is None or not _starts_as_captured(root, loc, moved, captured):
        return
    folder = captured.path.rpartition("/")[0]
    occupied = set(listing)

    def move(old: str, new: str, aside: bool) -> None:
        st = family[old]
        before(PutBack(path=f"{folder}/{new}", aside=f"{folder}/{new}" if aside else "",
                       dev=st.st_dev, ino=st.st_ino, moved_from=f"{folder}/{old}",
                       aside_ino=st.st_ino if aside else 0,
                       aside_uid=st.st_uid if aside else -1))
        rename_noreplace(loc.dirfd, old, new)
        occupied.discard(old)
        occupied.add(new)
        family[new] = st
        where[(st.st_dev, st.st_ino)] = new

    move(moved, moved + suffix, aside=True)
    recorded = {(dev, ino) for _, dev, ino in captured.rotated}
    if captured.at_ns:
        for name, st in sorted(family.items()):
            if (name != moved and _in_set(loc.name, name)
                    and (st.st_dev, st.st_ino) not in recorded
                    and st.st_mtime_ns > captured.at_ns):
                move(name, name + suffix, aside=True)
    pending = {name: (dev, ino) for name, dev, ino in captured.rotated}
    progress = True
    while progress:
        progress = False
        for target, identity in sorted(pending.items()):
            now = where.get(identity)
            if now is None or now == target or not _in_set(loc.name, now):
                del pending[target]
            elif target not in occupied:
                move(now, target, aside=False)
                del pending[target]
                progress = True


# ---- internals ------------------------------------------------------------------------------


ASIDE_MARK = ".ckptd-"


def _in_set(name: str, other: str) -> bool:
    return (other.startswith(name + ".") and ASIDE_MARK not in other
            and not other.endswith((PART, NEW)))


def _ours(st: os.stat_result, captured: CapturedFile) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == captured.uid


def entries(
    root: Root, loc: Located, wanted: Callable[[str], bool] = lambda name: True
) -> dict[str, os.stat_result]:
    """The ``wanted`` entries of ``loc``'s directory, read through a directory fd opened
    from the held one, each ``lstat``-ed relative to it (no link followed)."""
    dfd = root.open_in(loc, os.O_RDONLY | os.O_DIRECTORY, name=".")
    try:
        names = os.listdir(dfd)
    finally:
        os.close(dfd)
    found: dict[str, os.stat_result] = {}
    for name in filter(wanted, names):
        with contextlib.suppress(FileNotFoundError):
            found[name] = os.stat(name, dir_fd=loc.dirfd, follow_symlinks=False)
    return found


def _starts_as_captured(root: Root, loc: Located, name: str, captured: CapturedFile) -> bool:
    fd = root.open_in(loc, os.O_RDONLY | os.O_NONBLOCK, name=name)
    try:
        st = os.fstat(fd)
        return ((st.st_dev, st.st_ino) == (captured.dev, captured.ino)
                and _ours(st, captured) and st.st_size >= captured.size
                and hash_fd(fd, captured.size) == captured.hash)
    finally:
        os.close(fd)



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


def _write_aside(
    root: Root, loc: Located, fd: int, st: os.stat_result, name: str
) -> os.stat_result:
    """A copy of ``fd`` as ``name`` beside it: 0600, the file's owner's, complete and
    durable before it gets its name; what it is (its identity and owner, as made)."""
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
            made = os.fstat(out)
            rename_noreplace(loc.dirfd, part, name)
        except BaseException:
            _unlink_if_present(loc, part)
            raise
    finally:
        os.close(out)
    return made


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
