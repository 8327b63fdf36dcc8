"""Reading CRIU's own image files (only the few ckptd needs)."""

from __future__ import annotations

import struct
from pathlib import Path

from google.protobuf.message import DecodeError

from ckptd._gen.criu import pstree_pb2, stats_pb2

IMG_SERVICE_MAGIC = 0x55105940


def is_pages_image(name: str) -> bool:
    """Whether a CRIU image file holds raw memory pages (``pages-<n>.img``): the store
    splits those into pages; every other image is stored whole."""
    return name.startswith("pages-") and name.endswith(".img")

STATS_MAGIC = 0x57093306


def read_dump_stats(work_dir: Path) -> stats_pb2.dump_stats_entry | None:
    """The ``stats-dump`` image CRIU writes into its work directory after a dump; None if
    absent or unreadable."""
    try:
        raw = (work_dir / "stats-dump").read_bytes()
    except OSError:
        return None
    if len(raw) < 12:
        return None
    magic0, magic1, size = struct.unpack_from("<III", raw, 0)
    if magic0 != IMG_SERVICE_MAGIC or magic1 != STATS_MAGIC or len(raw) < 12 + size:
        return None
    entry = stats_pb2.stats_entry()
    try:
        entry.ParseFromString(raw[12 : 12 + size])
    except DecodeError:
        return None
    return entry.dump if entry.HasField("dump") else None


IMG_COMMON_MAGIC = 0x54564319
PSTREE_MAGIC = 0x50273030


def read_pstree(images_dir: Path) -> tuple[int, ...]:
    """The pids CRIU dumped (``pstree.img``), in image order (root first); () if unreadable."""
    try:
        raw = (images_dir / "pstree.img").read_bytes()
    except OSError:
        return ()
    if len(raw) < 8 or struct.unpack_from("<II", raw, 0) != (IMG_COMMON_MAGIC, PSTREE_MAGIC):
        return ()
    pids: list[int] = []
    offset = 8
    while offset + 4 <= len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            return ()  # an entry cut short
        entry = pstree_pb2.pstree_entry()
        try:
            entry.ParseFromString(raw[offset : offset + size])
        except DecodeError:
            return ()
        offset += size
        pids.append(entry.pid)
    return tuple(pids)
