"""CRIU's files.img read for TCP connections (issue 24): a socket with a peer is one whatever
its state (TCP_CLOSE after a reset included), IPv4 and IPv6; listening and unconnected
sockets and other files are not; an unreadable image is None, never a guess."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

from ckptd.adapters.criu.images import (
    FILES_MAGIC,
    IMG_COMMON_MAGIC,
    read_tcp_connections,
)
from ckptd.adapters.criu.variants import images_hold_connections
from ckptd.core.ports import CriuRestoreJob, ImageSource


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _isk(family: int, state: int, src: tuple[int, ...], sport: int, dst: tuple[int, ...],
         dport: int, proto: int = 6, ino: int = 77) -> bytes:
    msg = (_int(1, 1) + _int(2, ino) + _int(3, family) + _int(4, 1) + _int(5, proto)
           + _int(6, state) + _int(7, sport) + _int(8, dport) + _int(9, 2) + _int(10, 0))
    msg += b"".join(_int(11, w) for w in src) + b"".join(_int(12, w) for w in dst)
    return msg + _bytes(13, b"") + _bytes(14, b"")


def _image(*entries: bytes) -> bytes:
    out = struct.pack("<II", IMG_COMMON_MAGIC, FILES_MAGIC)
    for entry in entries:
        out += struct.pack("<I", len(entry)) + entry
    return out


def _file(kind: int, body: bytes, field: int = 4) -> bytes:
    return _int(1, kind) + _int(2, 1) + _bytes(field, body)


LO4 = (0x0100007F,)
LO6 = (0, 0, 0, 0x01000000)


def test_connections_in_every_state_are_read_and_the_rest_left_out(tmp_path: Path) -> None:
    (tmp_path / "files.img").write_bytes(_image(
        _file(4, _isk(2, 7, LO4, 35180, LO4, 34317, ino=5)),        # reset: TCP_CLOSE
        _file(4, _isk(10, 8, LO6, 4000, LO6, 5000, ino=6)),         # CLOSE_WAIT, IPv6
        _file(4, _isk(2, 10, LO4, 8080, (0,), 0)),                  # listening
        _file(4, _isk(2, 7, (0,), 0, (0,), 0)),                     # never connected
        _file(4, _isk(2, 1, LO4, 53, LO4, 5353, proto=17)),         # UDP
        _file(1, b"\x08\x01", field=3),                             # a regular file
    ))
    conns = read_tcp_connections(tmp_path)
    assert conns is not None
    assert [(c.local, c.remote, c.state, c.inode) for c in conns] == [
        ("127.0.0.1:35180", "127.0.0.1:34317", "CLOSE", 5),
        ("[::1]:4000", "[::1]:5000", "CLOSE_WAIT", 6),
    ]


def test_a_missing_or_damaged_image_is_none(tmp_path: Path) -> None:
    assert read_tcp_connections(tmp_path) is None
    (tmp_path / "files.img").write_bytes(b"\x00" * 12)
    assert read_tcp_connections(tmp_path) is None
    (tmp_path / "files.img").write_bytes(_image(_file(4, _isk(2, 1, LO4, 1, LO4, 2)))[:-3])
    assert read_tcp_connections(tmp_path) is None


class _Source:
    """A streamed restore's images (only what the check reads)."""

    def __init__(self, images: dict[str, bytes]) -> None:
        self.images = images

    def exists(self, name: str) -> bool:
        return name in self.images

    def chunks(self, name: str) -> Iterator[memoryview]:
        data = self.images[name]
        for i in range(0, len(data), 7):
            yield memoryview(data[i : i + 7])


def test_a_restore_of_images_holding_a_connection_is_told_so_from_a_directory_or_a_stream(
    tmp_path: Path,
) -> None:
    """An older checkpoint recorded no connection for a reset socket: the restore asks CRIU
    for tcp_established because its images hold one, streamed or not."""
    image = _image(_file(4, _isk(2, 7, LO4, 35180, LO4, 34317)))
    job = CriuRestoreJob(images_dir=tmp_path, work_dir=tmp_path)
    assert not images_hold_connections(job)
    (tmp_path / "files.img").write_bytes(image)
    assert images_hold_connections(job)
    streamed = replace(job, images_dir=tmp_path / "none",
                       images=cast(ImageSource, _Source({"files.img": image})))
    assert images_hold_connections(streamed)
    listening = _image(_file(4, _isk(2, 10, LO4, 8080, (0,), 0)))
    assert not images_hold_connections(
        replace(streamed, images=cast(ImageSource, _Source({"files.img": listening}))))
