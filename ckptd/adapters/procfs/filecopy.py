"""A written file's content copied into a checkpoint image, by extent.

Invariants:
- content is read only through the writing process's own descriptor or mapping
  (``WrittenFile.source``: ``/proc/PID/fd/N``, ``/proc/PID/map_files/A-B``), never by path;
- only data extents are read and written (``SEEK_DATA``/``SEEK_HOLE``): a hole stays a hole
  in the image (which the store keeps as zero pages, for nothing), so a 2 GiB sparse file
  with 4 KiB of data costs 4 KiB of reading and of staging, not 2 GiB; the hash is the hash
  of every byte all the same (holes hashed as zeros).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptd.core.ports import Precopy, WrittenFile
from ckptd.domain import CapturedFile

PAGE = 4096
BLOCK = 1 << 20
_ZEROS = bytes(BLOCK)


@dataclass
class _Copied:
    """A precopy's state: which file it was, and the hash of what was copied."""

    dev: int
    ino: int
    digest: Any


def extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The data extents ``[offset, offset + length)`` of ``fd`` between ``start`` and
    ``end`` (the whole range where the file system cannot say)."""
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


def copy_range(src: int, start: int, end: int, out: int, digest: Any) -> None:
    """``src``'s bytes ``[start, end)`` into ``out`` at the same offsets, data extents only
    (``out`` is sized by the caller); ``digest`` updated with every byte, holes as zeros."""
    offset = start
    for data, length in extents(src, start, end):
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


def precopy_file(file: WrittenFile, dest: Path) -> Precopy | None:
    """What ``file`` holds now, copied to ``dest`` (no padding yet)."""
    try:
        src = os.open(file.source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    digest = xxhash.xxh3_128()
    try:
        st = os.fstat(src)
        size = st.st_size
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(out, size)
            copy_range(src, 0, size, out, digest)
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
        src = os.open(file.source, os.O_RDONLY | os.O_CLOEXEC)
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
            copy_range(src, start, size, out, digest)
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
