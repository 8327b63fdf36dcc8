"""ckptd.adapters.criu.pageserver without CRIU: a client speaking CRIU's side of the protocol
(as criu/page-xfer.c does) gets its answers, the pagemap images are framed as CRIU frames
them, the pages reach the sink in order within a bounded pool, and a failing sink fails the
session."""

from __future__ import annotations

import functools
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.criu import pageserver
from ckptd.adapters.criu.pageserver import (
    IMG_COMMON_MAGIC,
    IOV,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PS_IOV_ADD_F,
    PS_IOV_FORCE_CLOSE,
    PS_IOV_OPEN2,
    PS_IOV_PARENT,
    WIRE_41,
    WIRE_42,
    FileSink,
    PageServer,
    PageServerError,
    Wire,
    pagemap_entry,
    pagemap_entry_41,
    pagemap_head,
    wire_for,
)

PAGE = 4096


def _iov(cmd: int, nr_pages: int = 0, vaddr: int = 0, dst_id: int = 0, flags: int = 0) -> bytes:
    return IOV.pack(flags << 16 | cmd, nr_pages, vaddr, dst_id)


def _page(n: int) -> bytes:
    return bytes([n % 251]) * PAGE


def _recv_exact(sk: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sk.recv(n - len(data))
        assert part, "the server closed the socket"
        data += part
    return data


def _criu_side(sk: socket.socket, images: list[tuple[int, list[tuple[int, int, int]]]]) -> int:
    """What CRIU's dump sends: per image OPEN2 (one byte back), then ADD_F entries with their
    pages; FORCE_CLOSE; returns the status the server answered."""
    n = 0
    for dst_id, entries in images:
        sk.sendall(_iov(PS_IOV_OPEN2, dst_id=dst_id))
        assert _recv_exact(sk, 1) == b"\x00"
        for vaddr, nr, flags in entries:
            sk.sendall(_iov(PS_IOV_ADD_F, nr, vaddr, dst_id, flags))
            if flags & PE_PRESENT:
                for _ in range(nr):
                    sk.sendall(_page(n))
                    n += 1
    sk.sendall(_iov(PS_IOV_PARENT, dst_id=images[0][0]))
    assert struct.unpack("<i", _recv_exact(sk, 4)) == (0,)
    sk.sendall(_iov(PS_IOV_FORCE_CLOSE))
    status: int = struct.unpack("<i", _recv_exact(sk, 4))[0]
    return status


def _run(tmp_path: Path, images: list[tuple[int, list[tuple[int, int, int]]]],
         sink: object = None, **kw: int) -> tuple[PageServer, int]:
    server = PageServer(tmp_path, sink or FileSink(tmp_path), **kw)  # type: ignore[arg-type]
    server.start()
    criu = server.criu_end()
    status: list[int] = []
    client = threading.Thread(target=lambda: status.append(_criu_side(criu, images)))
    client.start()
    client.join(30)
    try:
        server.wait(30)
    finally:
        server.close_criu_end()
    return server, status[0] if status else -99


def test_images_are_framed_as_criu_s_and_pages_arrive_in_order(tmp_path: Path) -> None:
    pid_img = 1234 << 8 | 1
    shm_img = 7 << 8 | 2
    present, lazy = PE_PRESENT, PE_PRESENT | PE_LAZY
    server, status = _run(tmp_path, [
        (pid_img, [(0x400000, 3, present), (0x7F0000, 1, PE_PARENT), (0x900000, 300, lazy)]),
        (shm_img, [(0, 2, present)]),
    ], chunk=16 * PAGE, buffers=2)
    assert status == 0
    head = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC)
    assert (tmp_path / "pagemap-1234.img").read_bytes() == (
        head + pagemap_head(1) + pagemap_entry(0x400000, 3, present)
        + pagemap_entry(0x7F0000, 1, PE_PARENT) + pagemap_entry(0x900000, 300, lazy))
    assert (tmp_path / "pagemap-shmem-7.img").read_bytes() == (
        head + pagemap_head(2) + pagemap_entry(0, 2, present))
    assert (tmp_path / "pages-1.img").read_bytes() == b"".join(_page(i) for i in range(303))
    assert (tmp_path / "pages-2.img").read_bytes() == _page(303) + _page(304)
    assert server.stats.pages == 305
    assert server.stats.images == ["pagemap-1234.img", "pages-1.img",
                                   "pagemap-shmem-7.img", "pages-2.img"]
    assert server.stats.peak_buffers <= 2


def test_pagemap_entries_encode_as_protobuf() -> None:
    # CRIU 4.2: vaddr=0x400000 (1), compat_nr_pages=0 (2), flags=4 (4), nr_pages=3 (5)
    assert pagemap_entry(0x400000, 3, 4) == b"\x0b\x00\x00\x00" + bytes(
        [0x08, 0x80, 0x80, 0x80, 0x02, 0x10, 0x00, 0x20, 0x04, 0x28, 0x03])
    # CRIU 4.1: vaddr, nr_pages (2), flags (4)
    assert pagemap_entry_41(0x400000, 3, 4) == b"\x09\x00\x00\x00" + bytes(
        [0x08, 0x80, 0x80, 0x80, 0x02, 0x10, 0x03, 0x20, 0x04])
    assert wire_for("4.1.1") is WIRE_41 and wire_for("4.2.1") is WIRE_42
    assert IOV.size == 32 and WIRE_41.iov.size == 24
    assert pagemap_head(1) == b"\x02\x00\x00\x00\x08\x01"


class _Failing(FileSink):
    def pages(self, name: str, offset: int, data: memoryview) -> None:
        raise OSError("disk full")


def test_a_failing_sink_fails_the_session(tmp_path: Path) -> None:
    server = PageServer(tmp_path, _Failing(tmp_path), chunk=PAGE, buffers=1)
    server.start()
    criu = server.criu_end()
    result: list[object] = []

    def client() -> None:
        try:
            result.append(_criu_side(criu, [(1 << 8 | 1, [(0x1000, 50, PE_PRESENT)])]))
        except (OSError, AssertionError) as exc:  # the server shut the socket
            result.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    with pytest.raises(PageServerError, match=r"disk full|sink failed"):
        server.wait(30)
    thread.join(30)
    assert result and result[0] != 0  # CRIU is never told all went well
    server.close_criu_end()


def _criu_burst(sk: socket.socket, wire: Wire, dst_id: int,
                entries: list[tuple[int, int, int]]) -> int:
    """CRIU's side with every entry of one image sent in one go (so that runs of them lie
    whole in the server's read buffer: its native path)."""
    def iov(cmd: int, nr: int = 0, vaddr: int = 0, dst: int = 0, flags: int = 0) -> bytes:
        return wire.iov.pack(flags << 16 | cmd, nr, vaddr, dst)

    sk.sendall(iov(PS_IOV_OPEN2, dst=dst_id))
    assert _recv_exact(sk, 1) == b"\x00"
    out, n = [], 0
    for vaddr, nr, flags in entries:
        out.append(iov(PS_IOV_ADD_F, nr, vaddr, dst_id, flags))
        if flags & PE_PRESENT:
            out += [_page(n + k) for k in range(nr)]
            n += nr
    sk.sendall(b"".join(out))
    sk.sendall(iov(PS_IOV_FORCE_CLOSE))
    status: int = struct.unpack("<i", _recv_exact(sk, 4))[0]
    return status


@pytest.mark.parametrize("wire", [WIRE_42, WIRE_41], ids=["criu-4.2", "criu-4.1"])
def test_runs_of_small_entries_are_taken_natively_exactly_as_in_python(
    tmp_path: Path, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: 3000 entries of 1-5 pages (holes, lazy ones, vaddrs of every varint length)
    give the same pagemap and pages images, and the same counts, through the native inner
    loop as through the Python one; the pool stays bounded (chunks of 16 pages: runs stop at
    a chunk's end and go on in the next)."""
    import random

    rng = random.Random(35)
    flags = [PE_PRESENT, PE_PRESENT, PE_PARENT, PE_PRESENT | PE_LAZY]
    entries = [(rng.choice([0x1000 * i, 0x7FFF_0000_0000 + 0x1000 * i, 0x80 * i]),
                rng.randint(1, 5), rng.choice(flags)) for i in range(3000)]
    dst_id = 99 << 8 | 1
    results = []
    real = getattr(pageserver, "_native_entries")  # noqa: B009 (private)
    assert real is not None, "ckptd._pages is not built"
    taken = [0]

    def counting(*args: Any) -> tuple[int, int, bytes, int, int]:
        got: tuple[int, int, bytes, int, int] = real(*args)
        taken[0] += got[3]
        return got

    for native in (True, False):
        monkeypatch.setattr(pageserver, "_native_entries", counting if native else None)
        out = tmp_path / ("native" if native else "python")
        out.mkdir()
        server = PageServer(out, FileSink(out), chunk=16 * PAGE, buffers=2, wire=wire)
        server.start()
        status: list[int] = []
        send = functools.partial(_criu_burst, server.criu_end(), wire, dst_id, entries)
        client = threading.Thread(target=lambda send=send, status=status: status.append(send()))
        client.start()
        client.join(60)
        try:
            server.wait(30)
        finally:
            server.close_criu_end()
        assert status == [0]
        results.append(((out / "pagemap-99.img").read_bytes(), (out / "pages-1.img").read_bytes(),
                        server.stats.entries, server.stats.pages, server.stats.bytes_received))
        assert server.stats.peak_buffers <= 2
    assert results[0] == results[1]
    head = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + pagemap_head(1)
    assert results[0][0] == head + b"".join(wire.entry(*e) for e in entries)
    assert results[0][2] == 3000
    assert results[0][3] == sum(nr for _, nr, f in entries if f & PE_PRESENT)
    assert taken[0] > 1000, f"only {taken[0]} of 3000 entries took the native path"
