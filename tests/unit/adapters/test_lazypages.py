"""ckptd.adapters.criu.lazypages without CRIU: pagemap images parsed as CRIU 4.1 and 4.2 write
them, pages located by address, a lazy restore's images staged (pages sparse, only what CRIU
reads itself), and the page service answering a peer that speaks CRIU's lazy-pages side of the
protocol (``criu/uffd.c``) over a real socketpair: exactly the asked pages, verified; nothing
at all for a request it cannot answer."""

from __future__ import annotations

import socket
import struct
import threading
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.adapters.criu import lazyimages, lazypages
from ckptd.adapters.criu.lazyimages import Entry, Pagemap, parse_pagemap, stage
from ckptd.adapters.criu.lazypages import PageServing, UffdCopies
from ckptd.adapters.criu.pageserver import (
    IMG_COMMON_MAGIC,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PS_IOV_ADD_F,
    PS_IOV_CLOSE,
    PS_IOV_FORCE_CLOSE,
    PS_IOV_GET,
    Wire,
    pagemap_entry,
    pagemap_entry_41,
    pagemap_head,
    wire_for,
)
from ckptd.core.store.restream import DirectoryImages
from ckptd.errors import CorruptCheckpoint, CriuFailed

PAGE = 4096
BASE = 0x7F00_0000_0000
WIRES = [pytest.param(wire_for("4.2.1"), id="criu-4.2"),
         pytest.param(wire_for("4.1.1"), id="criu-4.1")]
EntryFn = Callable[[int, int, int], bytes]


@pytest.fixture(autouse=True, scope="module", params=["native", "python"])
def reader(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test with each pagemap reader: ``ckptd._pages.pagemap_columns``, and the Python
    one a node without the native module uses."""
    if request.param == "native" and lazyimages._native_columns is None:
        pytest.skip("ckptd._pages is not built")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "python":
            mp.setattr(lazyimages, "_native_columns", None)
        yield str(request.param)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _framed(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _pagemap(pages_id: int, entries: list[tuple[int, int, int]], entry: EntryFn) -> bytes:
    head = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + pagemap_head(pages_id)
    return head + b"".join(entry(vaddr, nr, flags) for vaddr, nr, flags in entries)


def _page(n: int) -> bytes:
    return bytes([n % 251 + 1]) * PAGE


# ---- parse_pagemap ----------------------------------------------------------------------------

MIXED = [  # (vaddr, nr_pages, flags): data, a hole in the parent, lazy data, zero pages, data
    (BASE, 3, PE_PRESENT),
    (BASE + 0x10000, 2, PE_PARENT),
    (BASE + 0x20000, 4, PE_PRESENT | PE_LAZY),
    (BASE + 0x30000, 5, 0),
    (BASE + 0x40000, 1, PE_PRESENT),
]


@pytest.mark.parametrize("entry", [pagemap_entry, pagemap_entry_41], ids=["criu-4.2", "criu-4.1"])
def test_first_page_indices_count_only_entries_with_data(entry: EntryFn) -> None:
    pagemap = parse_pagemap(_pagemap(7, MIXED, entry), "pagemap-1.img")
    assert pagemap.pages_name == "pages-7.img"
    assert pagemap.entries == (
        Entry(BASE, 3, PE_PRESENT, 0),
        Entry(BASE + 0x10000, 2, PE_PARENT, 3),
        Entry(BASE + 0x20000, 4, PE_PRESENT | PE_LAZY, 3),
        Entry(BASE + 0x30000, 5, 0, 7),
        Entry(BASE + 0x40000, 1, PE_PRESENT, 7),
    )
    assert list(pagemap.starts) == [v for v, _, _ in MIXED]
    assert len(pagemap) == len(MIXED)
    assert list(pagemap.eager()) == [pagemap.entry(0), pagemap.entry(4)]
    assert [e.has_data for e in pagemap.entries] == [True, False, True, False, True]
    assert [e.lazy for e in pagemap.entries] == [False, False, True, False, False]


def test_flags_default_to_present_or_in_parent_as_old_crius_wrote_them() -> None:
    """No ``flags`` (field 4): ``in_parent`` (field 3) set means PE_PARENT, else PE_PRESENT."""
    head = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + pagemap_head(2)
    raw = (head
           + _framed(b"\x08" + _varint(BASE) + b"\x10" + _varint(2))
           + _framed(b"\x08" + _varint(BASE + 0x4000) + b"\x10" + _varint(3) + b"\x18\x01")
           + _framed(b"\x08" + _varint(BASE + 0x8000) + b"\x10" + _varint(1) + b"\x18\x00"))
    pagemap = parse_pagemap(raw, "pagemap-9.img")
    assert pagemap.entries == (
        Entry(BASE, 2, PE_PRESENT, 0),
        Entry(BASE + 0x4000, 3, PE_PARENT, 2),
        Entry(BASE + 0x8000, 1, PE_PRESENT, 2),
    )


def test_a_pagemap_of_its_head_alone_has_no_entries(reader: str) -> None:
    del reader  # (the fixture chose the reader)
    raw = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + pagemap_head(4)
    pagemap = parse_pagemap(raw, "pagemap-1.img")
    assert pagemap.pages_name == "pages-4.img"
    assert pagemap.entries == () and len(pagemap) == 0
    assert pagemap.locate(BASE) is None


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "is not a pagemap image"),
        (struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC + 1) + pagemap_head(1),
         "is not a pagemap image"),
        (struct.pack("<II", IMG_COMMON_MAGIC + 1, PAGEMAP_MAGIC) + pagemap_head(1),
         "is not a pagemap image"),
        (struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC), "no head"),
        (_pagemap(1, [(BASE, 2, PE_PRESENT)], pagemap_entry)[:-1], "an entry cut short"),
        (_pagemap(1, [(BASE, 2, PE_PRESENT)], pagemap_entry) + b"\x05\x00", "an entry cut short"),
        (struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + _framed(b""), "no pages_id"),
        (struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + pagemap_head(1)
         + _framed(b"\x20\x04"), "without vaddr or nr_pages"),
    ],
    ids=["empty", "wrong-pagemap-magic", "wrong-common-magic", "no-head", "entry-cut-short",
         "size-cut-short", "no-pages-id", "entry-without-vaddr"],
)
def test_what_is_not_a_whole_pagemap_is_a_value_error(raw: bytes, why: str,
                                                      reader: str) -> None:
    """A ValueError naming the image (the Python reader says why; the native one, for
    anything but the magic, "not a pagemap image (or one cut short)")."""
    with pytest.raises(ValueError) as info:
        parse_pagemap(raw, "pagemap-3.img")
    assert str(info.value).startswith("pagemap-3.img")
    if reader == "python" or why == "is not a pagemap image":
        assert why in str(info.value)


# ---- Pagemap.locate ---------------------------------------------------------------------------


def test_locate_finds_the_entry_with_data_holding_the_page() -> None:
    pagemap = parse_pagemap(_pagemap(1, MIXED, pagemap_entry), "pagemap-1.img")
    first, hole, lazy, zero, last = pagemap.entries
    assert pagemap.locate(BASE) == first  # an entry's start
    assert pagemap.locate(BASE + 2 * PAGE) == first  # inside: its last page
    assert pagemap.locate(BASE + 3 * PAGE) is None  # its end: a gap after it
    assert pagemap.locate(BASE + 0x8000) is None  # in the gap
    assert pagemap.locate(BASE - PAGE) is None  # before the first entry
    assert pagemap.locate(0) is None
    assert pagemap.locate(BASE + 0x10000) is None  # a hole (the parent's): no data here
    assert hole.vaddr == BASE + 0x10000
    assert pagemap.locate(BASE + 0x20000 + 3 * PAGE) == lazy
    assert pagemap.locate(BASE + 0x20000 + 4 * PAGE) is None
    assert pagemap.locate(BASE + 0x30000 + PAGE) is None  # zero pages: no data
    assert zero.flags == 0
    assert pagemap.locate(BASE + 0x40000) == last
    assert pagemap.locate(BASE + 0x40000 + PAGE) is None  # past the last entry's end
    assert pagemap.locate(1 << 60) is None


def test_locate_in_an_empty_pagemap() -> None:
    empty = Pagemap("pages-1.img", array("Q"), array("Q"), array("I"), array("Q"))
    assert empty.locate(BASE) is None and empty.entries == ()


# ---- stage ------------------------------------------------------------------------------------

TASK = [  # pagemap-1.img -> pages-1.img
    (BASE, 2, PE_PRESENT),  # a stack: eager
    (BASE + 0x10000, 256, PE_PRESENT | PE_LAZY),  # anonymous memory: 1 MiB served lazily
    (BASE + 0x200000, 3, PE_PARENT),
    (BASE + 0x300000, 1, PE_PRESENT),
    (BASE + 0x400000, 2, PE_PRESENT | PE_LAZY),
]
TASK_PAGES = sum(n for _, n, f in TASK if f & PE_PRESENT)
SHMEM = [(0, 2, PE_PRESENT), (0x4000, 1, PE_PRESENT | PE_LAZY)]


def _dumped(directory: Path, entry: EntryFn = pagemap_entry) -> Path:
    directory.mkdir()
    (directory / "pagemap-1.img").write_bytes(_pagemap(1, TASK, entry))
    (directory / "pages-1.img").write_bytes(b"".join(_page(i) for i in range(TASK_PAGES)))
    (directory / "pagemap-shmem-77.img").write_bytes(_pagemap(2, SHMEM, entry))
    (directory / "pages-2.img").write_bytes(b"".join(_page(100 + i) for i in range(3)))
    (directory / "pages-9.img").write_bytes(_page(200) * 2)  # named by no pagemap
    (directory / "core-1.img").write_bytes(b"core" * 100)
    (directory / "inventory.img").write_bytes(b"inventory")
    return directory


def test_stage_writes_every_image_and_only_the_eager_pages(tmp_path: Path) -> None:
    dumped = _dumped(tmp_path / "dumped")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "core-1.img").write_bytes(b"put back before")  # a captured image already there
    maps = stage(DirectoryImages(dumped, "ck-1"), staged)

    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in dumped.iterdir())
    assert (staged / "core-1.img").read_bytes() == b"put back before"  # left as it was
    for name in ("inventory.img", "pagemap-1.img", "pagemap-shmem-77.img", "pages-9.img"):
        assert (staged / name).read_bytes() == (dumped / name).read_bytes(), name

    assert list(maps) == [1]  # tasks by image id; shared memory is no task's
    parsed = parse_pagemap((dumped / "pagemap-1.img").read_bytes(), "pagemap-1.img")
    assert (maps[1].pages_name, maps[1].entries) == (parsed.pages_name, parsed.entries)

    staged_pages = (staged / "pages-1.img").read_bytes()
    assert len(staged_pages) == (dumped / "pages-1.img").stat().st_size
    want = bytearray(len(staged_pages))
    for e in maps[1].entries:
        if e.has_data and not e.lazy:
            at = e.first * PAGE
            want[at:at + e.nr_pages * PAGE] = (dumped / "pages-1.img").read_bytes()[
                at:at + e.nr_pages * PAGE]
    assert staged_pages == bytes(want)
    assert staged_pages[:2 * PAGE] == _page(0) + _page(1)
    assert staged_pages[2 * PAGE:258 * PAGE] == bytes(256 * PAGE)  # lazy: not written
    assert staged_pages[258 * PAGE:259 * PAGE] == _page(258)
    assert staged_pages[259 * PAGE:] == bytes(2 * PAGE)
    # sparse: the lazy megabyte takes no blocks
    assert (staged / "pages-1.img").stat().st_blocks * 512 < 64 * PAGE

    shm = (staged / "pages-2.img").read_bytes()
    assert shm == _page(100) + _page(101) + bytes(PAGE)


def test_stage_of_a_damaged_pagemap_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    dumped = _dumped(tmp_path / "dumped")
    (dumped / "pagemap-1.img").write_bytes(b"\x00" * 16)
    staged = tmp_path / "staged"
    staged.mkdir()
    with pytest.raises(CorruptCheckpoint) as info:
        stage(DirectoryImages(dumped, "ck-bad"), staged)
    assert info.value.checkpoint_id == "ck-bad"
    assert "ck-bad" in info.value.message and "pagemap-1.img" in info.value.message
    assert isinstance(info.value.__cause__, ValueError)


# ---- PageServing ------------------------------------------------------------------------------


def _recv_exact(sk: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sk.recv(n - len(data))
        assert part, f"the server closed the socket after {len(data)} of {n} bytes"
        data += part
    return data


class Served:
    """``PageServing.run`` on one end of a socketpair, in a thread; the test is the lazy
    daemon on the other end."""

    def __init__(self, tmp_path: Path, wire: Wire, entry: EntryFn | None = None) -> None:
        self.dumped = _dumped(tmp_path / "dumped", entry or wire.entry)
        staged = tmp_path / "staged"
        staged.mkdir()
        self.images = DirectoryImages(self.dumped, "ck-lazy")
        self.maps = stage(self.images, staged)
        self.wire = wire
        self.ours, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.peer.settimeout(10)
        self.serving = PageServing(self.ours, self.images, self.maps, wire)
        self.result: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.result = self.serving.run()
        except BaseException as exc:
            self.error = exc

    def ask(self, cmd: int, nr_pages: int = 0, vaddr: int = 0, dst_id: int = 0) -> None:
        self.peer.sendall(self.wire.iov.pack(cmd, nr_pages, vaddr, dst_id))

    def get(self, vaddr: int, nr_pages: int, dst_id: int = 1) -> tuple[int, int, int, int, bytes]:
        self.ask(PS_IOV_GET, nr_pages, vaddr, dst_id)
        cmd, nr, at, dst = self.wire.iov.unpack(_recv_exact(self.peer, self.wire.iov.size))
        return cmd, nr, at, dst, _recv_exact(self.peer, nr * PAGE)

    def ended(self) -> BaseException | None:
        self.thread.join(10)
        assert not self.thread.is_alive(), "PageServing.run did not return"
        return self.error

    def close(self) -> None:
        self.ours.close()
        self.peer.close()


def _dumped_pages(served: Served, first: int, count: int) -> bytes:
    return (served.dumped / "pages-1.img").read_bytes()[first * PAGE:(first + count) * PAGE]


@pytest.mark.parametrize("wire", WIRES)
def test_each_request_is_answered_with_the_pages_of_the_images(tmp_path: Path,
                                                               wire: Wire) -> None:
    served = Served(tmp_path, wire)
    try:
        present = PE_PRESENT << 16 | PS_IOV_ADD_F
        lazy_at = BASE + 0x10000
        # a page touched in the middle of the lazy megabyte
        assert served.get(lazy_at + 10 * PAGE, 1) == (
            present, 1, lazy_at + 10 * PAGE, 1, _dumped_pages(served, 12, 1))
        # a run, from the entry's start
        assert served.get(lazy_at, 16) == (present, 16, lazy_at, 1, _dumped_pages(served, 2, 16))
        # more than the entry holds: clipped to its end
        assert served.get(lazy_at + 250 * PAGE, 20) == (
            present, 6, lazy_at + 250 * PAGE, 1, _dumped_pages(served, 252, 6))
        tail = BASE + 0x400000
        assert served.get(tail, 2) == (present, 2, tail, 1, _dumped_pages(served, 259, 2))
        # an eager entry asked again is served too (the daemon decides what it asks for)
        assert served.get(BASE + PAGE, 1) == (present, 1, BASE + PAGE, 1, _page(1))

        served.ask(PS_IOV_CLOSE)
        assert struct.unpack("<i", _recv_exact(served.peer, 4)) == (0,)
        assert served.ended() is None
        assert served.result == 1 + 16 + 6 + 2 + 1
        assert served.serving.pages == served.result and served.serving.requests == 5
        served.ours.close()
        assert served.peer.recv(1) == b""  # nothing after the status
    finally:
        served.close()


@pytest.mark.parametrize("wire", WIRES)
def test_force_close_ends_the_service_too(tmp_path: Path, wire: Wire) -> None:
    served = Served(tmp_path, wire)
    try:
        served.ask(PS_IOV_FORCE_CLOSE)
        assert struct.unpack("<i", _recv_exact(served.peer, 4)) == (0,)
        assert served.ended() is None and served.result == 0
    finally:
        served.close()


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(
    ("vaddr", "nr_pages", "dst_id"),
    [
        (BASE + 0x200000, 1, 1),  # a hole: the parent's page
        (BASE + 0x8000, 1, 1),  # a gap between entries
        (BASE - PAGE, 1, 1),  # before the first entry
        (BASE + 0x400000 + 2 * PAGE, 1, 1),  # past the last entry
        (BASE, 1, 2),  # a task the images do not have
        (BASE, 1, 77),  # the shared memory's id: no task's pagemap
        (BASE, 0, 1),  # no page at all
    ],
    ids=["hole", "gap", "before", "past-the-end", "unknown-task", "shmem-id", "zero-pages"],
)
def test_a_request_outside_the_images_is_left_unanswered(
    tmp_path: Path, wire: Wire, vaddr: int, nr_pages: int, dst_id: int
) -> None:
    """The task that touched the page must keep waiting (its tree is killed meanwhile): no
    byte goes back, not even a header."""
    served = Served(tmp_path, wire)
    try:
        assert served.get(BASE, 1)[4] == _page(0)  # served until then
        served.ask(PS_IOV_GET, nr_pages, vaddr, dst_id)
        error = served.ended()
        assert isinstance(error, CorruptCheckpoint), error
        assert error.checkpoint_id == "ck-lazy"
        assert f"{vaddr:#x}" in error.message and f"task {dst_id}" in error.message
        assert served.serving.pages == 1
        served.ours.close()  # what LazyRun's failure path does last (daemon.kill)
        assert served.peer.recv(1 << 16) == b""  # end of file: nothing was sent back
    finally:
        served.close()


@pytest.mark.parametrize("wire", WIRES)
def test_a_damaged_pages_image_is_left_unanswered(tmp_path: Path, wire: Wire) -> None:
    """The images cannot give the pages (here: a pages image cut short): the source's error,
    and not a byte back."""
    served = Served(tmp_path, wire)
    try:
        with open(served.dumped / "pages-1.img", "r+b") as fh:
            fh.truncate(100 * PAGE)
        served.ask(PS_IOV_GET, 1, BASE + 0x10000 + 200 * PAGE, 1)
        error = served.ended()
        assert isinstance(error, IndexError), error
        served.ours.close()
        assert served.peer.recv(1 << 16) == b""
    finally:
        served.close()


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("partial", [0, 7], ids=["between-requests", "mid-request"])
def test_a_hang_up_before_close_is_a_criu_failure(tmp_path: Path, wire: Wire,
                                                  partial: int) -> None:
    served = Served(tmp_path, wire)
    try:
        assert served.get(BASE + 0x10000, 3)[1] == 3
        served.peer.sendall(b"\x07" * partial)
        served.peer.close()
        error = served.ended()
        assert isinstance(error, CriuFailed), error
        assert "hung up after 3 pages of ck-lazy" in error.message
    finally:
        served.ours.close()


@pytest.mark.parametrize("wire", WIRES)
def test_a_command_other_than_a_page_request_is_a_criu_failure(tmp_path: Path,
                                                               wire: Wire) -> None:
    served = Served(tmp_path, wire)
    try:
        served.ask(PS_IOV_ADD_F, 1, BASE, 1)
        error = served.ended()
        assert isinstance(error, CriuFailed), error
        assert "not a page request" in error.message
        served.ours.close()
        assert served.peer.recv(1 << 16) == b""
    finally:
        served.close()


def test_the_41_layout_read_with_the_42_wire_is_not_served_as_pages(tmp_path: Path) -> None:
    """The wire is CRIU's version's: a 4.1 request (nr_pages u32, no padding) read as a 4.2
    one is garbage, which must not be answered with pages."""
    served = Served(tmp_path, wire_for("4.2.1"), entry=pagemap_entry_41)
    try:
        served.peer.sendall(wire_for("4.1.1").iov.pack(PS_IOV_GET, 1, BASE, 1) + bytes(8))
        error = served.ended()
        assert error is not None
        served.ours.close()
        assert served.peer.recv(1 << 16) == b""
    finally:
        served.close()


# ---- UffdCopies: a copy is held only while the daemon holds the same file ------------------

_HOLDER = r"""
import os, sys
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
print(" ".join(map(str, fds)), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "close":
        os.close(int(arg))
        print("ok", flush=True)
    elif cmd == "reuse":  # the number freed, then taken by another file
        os.close(int(arg))
        os.open("/dev/zero", os.O_RDONLY)
        print("ok", flush=True)
"""


class _Holder:
    """A process holding three files, closing (or reusing) one on command: CRIU's lazy-pages
    daemon as ``UffdCopies`` sees it."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.fds = [int(x) for x in self.proc.stdout.readline().split()]

    def do(self, command: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def copies(self) -> UffdCopies:
        import os

        copies = UffdCopies()
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            for fd in self.fds:  # as take() records them, without the userfaultfd filter
                copy = lazypages._pidfd_getfd(pidfd, fd)
                copies.fds.append(copy)
                copies._theirs[copy] = fd
        finally:
            os.close(pidfd)
        copies._pid = self.proc.pid
        return copies


@pytest.fixture
def holder() -> Iterator[_Holder]:
    h = _Holder()
    yield h
    h.proc.kill()
    h.proc.wait()


def test_a_copy_is_released_once_the_daemon_closes_its_file_and_only_that_one(
    holder: _Holder,
) -> None:
    copies = holder.copies()
    try:
        assert copies.release_closed() == 0 and len(copies.fds) == 3
        holder.do(f"close {holder.fds[0]}")
        assert copies.release_closed() == 1 and len(copies.fds) == 2
        holder.do(f"reuse {holder.fds[1]}")  # same number, another file: closed all the same
        assert copies.release_closed() == 1 and len(copies.fds) == 1
        assert copies.release_closed() == 0 and len(copies.fds) == 1
    finally:
        copies.close()
    assert copies.fds == []


def test_copies_are_kept_when_the_daemon_dies(holder: _Holder) -> None:
    """A daemon that dies closes every file it holds; the tasks must then wait on their
    next missing page (until ckptd kills them), not be let go to read zeros."""
    copies = holder.copies()
    try:
        holder.proc.kill()
        holder.proc.wait(10)  # reaped: its pid no longer names it
        assert copies.release_closed() == 0 and len(copies.fds) == 3
    finally:
        copies.close()
