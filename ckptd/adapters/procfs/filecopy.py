"""A written file's content copied into a checkpoint image, by extent.

Invariants:
- content is read only through the writing process's own descriptor or mapping
  (``WrittenFile.source``: ``/proc/PID/fd/N``, ``/proc/PID/map_files/A-B``), never by path;
- a file the job holds a lease on (``F_SETLEASE``: a ``LEASE`` line in its descriptor's
  fdinfo) is read through the job's own open file description (``pidfd_getfd``), not opened:
  an open(2) breaks a write lease and waits the kernel's lease-break time (45 s) for a holder
  that, frozen, can never answer; that description's offset is the job's, so it is read with
  pread only and never seeked (no extent search: holes are read as zeros);
- only data extents are read and written (``SEEK_DATA``/``SEEK_HOLE``): a hole stays a hole
  in the image (which the store keeps as zero pages, for nothing), so a 2 GiB sparse file
  with 4 KiB of data costs 4 KiB of reading and of staging, not 2 GiB; the hash is the hash
  of every byte all the same (holes hashed as zeros).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptd.adapters.procfs.pidfd import getfd
from ckptd.core.ports import NotCaptured, Precopy, WrittenFile
from ckptd.domain import CapturedFile

PAGE = 4096
BLOCK = 1 << 20
_ZEROS = bytes(BLOCK)
_FD_SOURCE = re.compile(r"/proc/(\d+)/fd/(\d+)")
_OWN_SOURCE = re.compile(r"/proc/self/fd/(\d+)")
"""A descriptor of ckptd's own (``outdirs``: a file under an output directory, held open
since it was found): read through a duplicate, never opened again."""


@dataclass
class _Copied:
    """A precopy's state: which file it was, and the hash of what was copied."""

    dev: int
    ino: int
    digest: Any


def extents(fd: int, start: int, end: int, seek: bool = True) -> Iterator[tuple[int, int]]:
    """The data extents ``[offset, offset + length)`` of ``fd`` between ``start`` and
    ``end`` (the whole range where the file system cannot say, or ``seek`` is False: ``fd``
    is another process's description, whose offset SEEK_DATA would move)."""
    if not seek:
        if start < end:
            yield start, end - start
        return
    offset = start
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return  # only a hole up to the end
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield offset, end - offset
                return
            raise
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole - data
        offset = hole


def copy_range(src: int, start: int, end: int, out: int, digest: Any,
               seek: bool = True) -> None:
    """``src``'s bytes ``[start, end)`` into ``out`` at the same offsets, data extents only
    (``out`` is sized by the caller); ``digest`` updated with every byte, holes as zeros.
    ``seek`` False: ``src`` is never seeked (see ``extents``)."""
    offset = start
    for data, length in extents(src, start, end, seek):
        _zeros(digest, data - offset)
        done = 0
        while done < length:
            chunk = os.pread(src, min(BLOCK, length - done), data + done)
            if not chunk:
                break  # shrank meanwhile: the rest reads as zeros in the image
            os.pwrite(out, chunk, data + done)
            digest.update(chunk)
            done += len(chunk)
        _zeros(digest, length - done)
        offset = data + length
    _zeros(digest, end - offset)


def _zeros(digest: Any, count: int) -> None:
    while count > 0:
        n = min(count, BLOCK)
        digest.update(_ZEROS[:n] if n < BLOCK else _ZEROS)
        count -= n


def leased(source: str) -> bool:
    """Whether ``source`` (``/proc/PID/fd/N``) is a descriptor of the job's that holds a lease
    (its fdinfo's ``lock:`` lines list the locks and leases of that open file description)."""
    fdinfo = source.replace("/fd/", "/fdinfo/")
    try:
        with open(fdinfo, encoding="ascii", errors="replace") as lines:
            return any(line.startswith("lock:") and " LEASE " in line for line in lines)
    except OSError:
        return False


def open_source(source: str) -> tuple[int, bool]:
    """A descriptor to read ``source``'s file from, and whether it may be seeked. A leased
    file (``leased``): the job's own description (``getfd``, checked to be the same file),
    never an open of ckptd's (an open breaks the lease); ``NotCaptured`` when that
    description is write-only or cannot be had. Any other file: opened read-only (its own
    description, free to seek); one of ckptd's own (``/proc/self/fd/N``): a duplicate of it.
    OSError when gone."""
    own = _OWN_SOURCE.fullmatch(source)
    if own is not None:
        return os.dup(int(own.group(1))), True
    match = _FD_SOURCE.fullmatch(source)
    if match is None or not leased(source):
        return os.open(source, os.O_RDONLY | os.O_CLOEXEC), True
    fd = getfd(int(match.group(1)), int(match.group(2)))  # OSError: gone
    try:
        st, want = os.fstat(fd), os.stat(source)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        os.close(fd)
        raise
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):  # its descriptor N changed
        os.close(fd)
        raise OSError(errno.ESTALE, f"{source} is another file now")
    if mode == os.O_WRONLY:
        os.close(fd)
        raise NotCaptured("leased by the job through a write-only descriptor: reading it "
                          "would break the lease; CRIU checks its size at the restore")
    return fd, False


def precopy_file(file: WrittenFile, dest: Path) -> Precopy | None:
    """What ``file`` holds now, copied to ``dest`` (no padding yet)."""
    try:
        src, seek = open_source(file.source)
    except (OSError, NotCaptured):  # the capture says why
        return None
    digest = xxhash.xxh3_128()
    try:
        st = os.fstat(src)
        size = st.st_size
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(out, size)
            copy_range(src, 0, size, out, digest, seek)
        finally:
            os.close(out)
    finally:
        os.close(src)
    return Precopy(file.path, size, _Copied(st.st_dev, st.st_ino, digest))


def capture_file(
    file: WrittenFile, dest: Path, precopy: Precopy | None = None,
    dirs: tuple[tuple[int, int, int], ...] = (), boot: str = "",
    rotated: tuple[tuple[str, int, int], ...] = (),
) -> CapturedFile | None:
    """Copy ``file``'s content (read through ``file.source``) to ``dest``, zero-padded to
    whole pages (zero pages cost nothing in the store); None when it is gone. After a
    ``precopy`` into ``dest`` of the same file, not shorter now: only the bytes appended
    since. ``dirs``/``boot``: the directories on its path as seen now (``safefs``);
    ``rotated``: its rotated set beside it; its own identity is read from ``file.source``."""
    try:
        src, seek = open_source(file.source)
    except OSError:
        return None
    try:
        at_ns = time.time_ns()
        st = os.fstat(src)
        size = st.st_size
        early = precopy.state if precopy is not None else None
        tail = (isinstance(early, _Copied) and precopy is not None
                and (early.dev, early.ino) == (st.st_dev, st.st_ino)
                and size >= precopy.size)
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
                      | (0 if tail else os.O_TRUNC), 0o600)
        try:
            padded = -(-size // PAGE) * PAGE
            if tail:
                assert isinstance(early, _Copied) and precopy is not None
                digest = early.digest.copy()
                start = precopy.size
                os.ftruncate(out, start)  # what was padded past the precopy reads as holes
            else:
                digest = xxhash.xxh3_128()
                start = 0
            os.ftruncate(out, padded)
            copy_range(src, start, size, out, digest, seek)
        finally:
            os.close(out)
    finally:
        os.close(src)
    return CapturedFile(
        path=file.path, size=size, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid,
        gid=st.st_gid, hash=digest.hexdigest(), image=dest.name, dirs=dirs, boot=boot,
        dev=st.st_dev, ino=st.st_ino, rotated=rotated, at_ns=at_ns,
    )


def hash_fd(fd: int, size: int) -> str:
    """xxh3-128 of ``fd``'s first ``size`` bytes, by extent (holes hashed as zeros)."""
    digest = xxhash.xxh3_128()
    offset = 0
    for data, length in extents(fd, 0, size):
        _zeros(digest, data - offset)
        done = 0
        while done < length:
            chunk = os.pread(fd, min(BLOCK, length - done), data + done)
            if not chunk:
                break
            digest.update(chunk)
            done += len(chunk)
        _zeros(digest, length - done)
        offset = data + length
    _zeros(digest, size - offset)
    return str(digest.hexdigest())
