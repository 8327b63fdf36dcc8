"""The regular files under a job's output directories (``ckptctl run --files DIR``), found
and held open for their capture.

Invariants:
- every directory and file is reached fd-relative from a pinned root (``safefs.Root``) with
  openat2 and no link followed (``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
  RESOLVE_BENEATH`` from each directory's fd), by the caller's thread with the checkpoint
  owner's file-system identity (the caller sets it): ckptd reads under DIR only what the
  job's owner could read, and never outside DIR through a link planted in it;
- each file is held open (read-only, ``O_NONBLOCK``: a FIFO swapped in never blocks, and a
  lease held on the file by another process fails the open instead of waiting out its
  break time) from the moment it is found until the capture read it: its content is read
  through that descriptor (``/proc/self/fd/N``), so a name swapped meanwhile changes nothing;
- a file the tree itself writes (``leave_out``, by identity) is left to the tree's own
  capture, and never opened here (an open of a file the job leases would break the lease);
- at most ``limit`` files are held: one more says that the directories hold more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ckptd.adapters.procfs.safefs import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    Root,
    UnsafePath,
    openat2,
)
from ckptd.core.ports.files import DirFiles, WrittenFile

MAX_DEPTH = 64
"""Deeper directories are not walked (said as a problem)."""
_RESOLVE = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
_REASONS = {errno.ENOENT: "no such directory", errno.ENOTDIR: "not a directory",
            errno.EACCES: "the job's owner may not read it",
            errno.EPERM: "the job's owner may not read it",
            errno.EWOULDBLOCK: "another process holds a lease on it"}


@dataclass
class _Walk:
    pid: int
    leave_out: Collection[tuple[int, int]]
    limit: int
    held: list[int] = field(default_factory=list)
    files: list[WrittenFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seen: set[tuple[int, int]] = field(default_factory=set)
    over: bool = False


def open_under(root: Root, dirs: Sequence[str], pid: int,
               leave_out: Sequence[WrittenFile], limit: int) -> tuple[DirFiles, list[int]]:
    """Every regular file under each of ``dirs`` (as ``root`` resolves them) but those of
    ``leave_out`` (by identity, read through their sources), held open, as a ``WrittenFile``
    of ``pid``'s whose source is that descriptor; and the descriptors, which the caller
    closes (``close_all``) once the capture is done. Each file once, in path order."""
    walk = _Walk(pid, _identities(leave_out), limit)
    try:
        for path in dirs:
            if walk.over:
                break
            try:
                top = _open_dir(root, path)
            except (OSError, UnsafePath) as exc:
                walk.problems.append(f"{path} ({_reason(exc)})")
                continue
            try:
                _walk_dir(walk, top, path, 0)
            finally:
                os.close(top)
    except BaseException:
        close_all(walk.held)
        raise
    return DirFiles(tuple(walk.files), tuple(walk.problems), walk.over), walk.held


def _open_dir(root: Root, path: str) -> int:
    with root.locate(path) as loc:
        try:
            return root.open_in(loc, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(loc.dirfd, loc.name):
                raise UnsafePath(errno.ELOOP, f"{path} is a symbolic link: ckptd follows "
                                 "none; give the directory it points to") from exc
            raise


def _is_link(dirfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk_dir(walk: _Walk, dirfd: int, path: str, depth: int) -> None:
    try:
        names = sorted(os.listdir(dirfd))
    except OSError as exc:
        walk.problems.append(f"{path} ({_reason(exc)})")
        return
    for name in names:
        if walk.over:
            return
        where = f"{path}/{name}"
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISDIR(st.st_mode):
            if depth + 1 >= MAX_DEPTH:
                walk.problems.append(f"{where} (deeper than {MAX_DEPTH} directories)")
                continue
            try:
                sub = openat2(dirfd, name, os.O_RDONLY | os.O_DIRECTORY, 0, _RESOLVE)
            except OSError as exc:
                walk.problems.append(f"{where} ({_reason(exc)})")
                continue
            try:
                _walk_dir(walk, sub, where, depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            _hold_file(walk, dirfd, name, where, st)


def _hold_file(walk: _Walk, dirfd: int, name: str, where: str, st: os.stat_result) -> None:
    key = (st.st_dev, st.st_ino)
    if key in walk.leave_out or key in walk.seen:
        return
    if len(walk.files) >= walk.limit:
        walk.over = True
        return
    try:
        fd = openat2(dirfd, name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, 0, _RESOLVE)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            walk.problems.append(f"{where} ({_reason(exc)})")
        return
    held = os.fstat(fd)
    if not stat.S_ISREG(held.st_mode) or (held.st_dev, held.st_ino) != key:
        os.close(fd)  # swapped between the look and the open: not the file that was seen
        walk.problems.append(f"{where} (replaced while it was read)")
        return
    walk.held.append(fd)
    walk.seen.add(key)
    walk.files.append(WrittenFile(where, held.st_size, f"/proc/self/fd/{fd}", walk.pid,
                                  size_free=True))


def _identities(files: Sequence[WrittenFile]) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for file in files:
        with contextlib.suppress(OSError):
            st = os.stat(file.source)
            found.add((st.st_dev, st.st_ino))
    return found


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnsafePath):
        return str(exc.strerror or exc)
    if isinstance(exc, OSError):
        return _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
    return str(exc)
