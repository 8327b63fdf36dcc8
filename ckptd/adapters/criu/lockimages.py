"""The file locks of a dump that its restore will not take back, read from CRIU's images.

CRIU (4.2.1) restores a task's file locks, then maps its files through descriptors it opens
and closes; closing any descriptor of a file drops every POSIX lock the process holds on it,
so a POSIX lock on a file the same process maps (shared or private) is gone after the restore
(SQLite in WAL mode: each connection's read lock on byte 128 of the ``-shm`` file it maps).
``flock`` and OFD locks belong to the open file, not the process, and come back; so do POSIX
locks on files the process does not map. Images read: ``pstree.img`` (the pids),
``ids-<pid>.img`` (its descriptor table), ``fdinfo-<table>.img`` (descriptor -> file),
``mm-<pid>.img`` (its mappings), ``files.img`` (the files' paths) and ``filelocks.img``;
decoded from the protobuf wire format as ``pathimages`` does.

Invariant: an image that cannot be read yields no line (this is a warning, never a refusal).
"""

from __future__ import annotations

import struct
from pathlib import Path

from ckptd.adapters.criu.images import proto_fields, read_pstree
from ckptd.adapters.criu.pathimages import entries

FL_POSIX = 1
_FD_REG = 1
_VMA_FILE = (1 << 6) | (1 << 7)  # VMA_FILE_PRIVATE | VMA_FILE_SHARED
_F_RDLCK, _F_WRLCK = 0, 1


def _messages(images_dir: Path, name: str) -> list[dict[int, int | bytes]]:
    return [dict(proto_fields(e)) for e in _raw_entries(images_dir, name)]


def _all_fields(message: bytes, number: int) -> list[bytes]:
    return [v for n, v in proto_fields(message) if n == number and isinstance(v, bytes)]


def lost_locks(images_dir: Path) -> tuple[str, ...]:
    """One line per POSIX lock of the dump that a restore will not take back (a lock on a
    file its process maps), naming the process, the file and the bytes; () if none or if an
    image cannot be read."""
    try:
        return _lost_locks(images_dir)
    except (OSError, ValueError, IndexError, struct.error, UnicodeDecodeError):
        return ()


def _lost_locks(images_dir: Path) -> tuple[str, ...]:
    locks = [m for m in _messages(images_dir, "filelocks.img") if m.get(1) == FL_POSIX]
    if not locks:
        return ()
    paths: dict[int, str] = {}
    for entry in _messages(images_dir, "files.img"):
        reg = entry.get(3)
        if entry.get(1) == _FD_REG and isinstance(reg, bytes):
            fields = dict(proto_fields(reg))
            name = fields.get(6)
            if isinstance(name, bytes) and isinstance(fields.get(1), int):
                text = name.decode()
                paths[int(fields[1])] = text if text.startswith("/") else f"/{text}"
    lines: list[str] = []
    for pid in read_pstree(images_dir):
        mine = [m for m in locks if m.get(3) == pid]
        if not mine:
            continue
        ids = _messages(images_dir, f"ids-{pid}.img")
        files_id = ids[0].get(2) if ids else None
        if not isinstance(files_id, int):
            continue
        fds = {int(m[4]): paths.get(int(m[1]), "") for m in
               _messages(images_dir, f"fdinfo-{files_id}.img")
               if isinstance(m.get(4), int) and isinstance(m.get(1), int)}
        mapped: set[str] = set()
        for mm_raw in _raw_entries(images_dir, f"mm-{pid}.img"):
            for vma_raw in _all_fields(mm_raw, 14):
                vma = dict(proto_fields(vma_raw))
                if int(vma.get(7, 0)) & _VMA_FILE and int(vma.get(4, 0)) in paths:
                    mapped.add(paths[int(vma[4])])
        for lock in mine:
            fd = int(lock.get(4, -1))
            path = fds.get(fd, "")
            if path and path in mapped:
                start, length = int(lock.get(5, 0)), int(lock.get(6, 0))
                span = (f"bytes {start}-{start + length - 1}" if length > 0
                        else f"bytes {start}-end")
                kind = "write" if int(lock.get(2, 0)) == _F_WRLCK else "read"
                lines.append(
                    f"{path}: the POSIX {kind} lock pid {pid} holds on {span} is not restored "
                    "(the process maps the file, and CRIU's restore drops a process's POSIX "
                    "locks on a file it maps; SQLite WAL's -shm is such a file: see "
                    "docs/limits.md)")
    return tuple(lines)


def _raw_entries(images_dir: Path, name: str) -> list[bytes]:
    try:
        raw = (images_dir / name).read_bytes()
    except FileNotFoundError:
        return []
    return list(entries(raw))
