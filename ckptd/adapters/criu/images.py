"""Reading CRIU's own image files (only the few ckptd needs)."""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import DecodeError

from ckptd._gen.criu import pstree_pb2, stats_pb2
from ckptd.domain import TcpConnection

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


FILES_MAGIC = 0x56303138
_FD_TYPES_INETSK = 4
_AF_INET6 = 10
_IPPROTO_TCP = 6
_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
               6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
               11: "CLOSING"}


def read_tcp_connections(images_dir: Path) -> tuple[TcpConnection, ...] | None:
    """The TCP sockets with a peer (``dst_port`` set) in CRIU's ``files.img``: the ones a
    restore must bring back as connections (CRIU then needs ``--tcp-established`` or
    ``--tcp-close``, whatever their state, TCP_CLOSE included), as ``TcpConnection`` with pid
    0 and the socket's inode. None when the image is missing or cannot be read.

    Decoded here from the protobuf wire format (``file_entry.isk``, ``inet_sk_entry``: only
    the fields named below), so that ckptd needs neither CRIU's ``crit`` nor all of its
    image schemas."""
    try:
        raw = (images_dir / "files.img").read_bytes()
    except OSError:
        return None
    return tcp_connections_in(raw)


def tcp_connections_in(raw: bytes) -> tuple[TcpConnection, ...] | None:
    """``read_tcp_connections`` of a ``files.img`` already read (``raw``)."""
    if len(raw) < 8 or struct.unpack_from("<II", raw, 0) != (IMG_COMMON_MAGIC, FILES_MAGIC):
        return None
    found: list[TcpConnection] = []
    offset = 8
    try:
        while offset + 4 <= len(raw):
            (size,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            if offset + size > len(raw):
                return None
            entry = raw[offset : offset + size]
            offset += size
            fields = dict(proto_fields(entry))
            isk = fields.get(4)
            if fields.get(1) != _FD_TYPES_INETSK or not isinstance(isk, bytes):
                continue
            conn = _inet_connection(isk)
            if conn is not None:
                found.append(conn)
    except (ValueError, IndexError, struct.error):
        return None
    return tuple(found)


def _inet_connection(isk: bytes) -> TcpConnection | None:
    ints: dict[int, int] = {}
    addrs: dict[int, list[int]] = {11: [], 12: []}
    for number, value in proto_fields(isk):
        if number in addrs:
            if isinstance(value, bytes):  # packed
                pos = 0
                while pos < len(value):
                    word, pos = _varint(value, pos)
                    addrs[number].append(word)
            else:
                addrs[number].append(value)
        elif isinstance(value, int):
            ints[number] = value
    if ints.get(5) != _IPPROTO_TCP or not ints.get(8):
        return None
    six = ints.get(3) == _AF_INET6

    def show(words: list[int], port: int) -> str:
        packed = b"".join(struct.pack("<I", w) for w in words)
        if six and len(packed) == 16:
            address = ipaddress.IPv6Address(packed)
            mapped = address.ipv4_mapped
            return f"{mapped}:{port}" if mapped is not None else f"[{address}]:{port}"
        return f"{ipaddress.IPv4Address(packed[:4])}:{port}"

    return TcpConnection(
        pid=0, comm="", local=show(addrs[11], ints.get(7, 0)), remote=show(addrs[12], ints[8]),
        state=_TCP_STATES.get(ints.get(6, 0), str(ints.get(6, 0))), inode=ints.get(2, 0),
    )


def proto_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int, length-delimited as
    bytes; fixed-width fields are skipped."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ValueError("field cut short")
            yield number, data[pos : pos + length]
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
