"""A receiver of CRIU's page-server protocol: a dump's pages reach ckptd while CRIU runs.

CRIU (``criu swrk``) is given one end of a socketpair as ``opts.ps.fd`` (honoured in swrk mode
only, ``criu/cr-service.c``); it then sends every pagemap entry and page over that socket
instead of writing ``pagemap-*.img`` and ``pages-*.img`` (``criu/page-xfer.c``), and writes
every other image to its images directory as usual. The protocol (CRIU 4.x, no TLS):

    struct page_server_iov { u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id; }   24 bytes, LE
    cmd = flags << 16 | command;   dst_id = image id << 8 | type (1: pid, 2: shmem)

    OPEN2   open pagemap <type, id>; answered with one byte, has_parent (0 here)
    OPEN    the same, unanswered (old CRIUs)
    PARENT  has the parent image <type, id>? answered with an int32 (0 here)
    ADD_F   one pagemap entry <vaddr, nr_pages, flags>; with PE_PRESENT its nr_pages * 4096
            bytes of pages follow
    ADD     ADD_F with PE_PRESENT;  HOLE: ADD_F with PE_PARENT (no data)
    CLOSE / FORCE_CLOSE   the end; answered with an int32 status (0) once all is received

CRIU's dump disconnects (FORCE_CLOSE) before its post-dump notification, so when ckptd is
notified every page has been received. The receiver writes each pagemap image itself, byte
for byte as CRIU's own page server would (``pagemap_head{pages_id}`` then one
``pagemap_entry`` per ADD, each image numbering its pages image ``pages-<n>.img`` from 1 in
the order the pagemaps are opened), into the images directory; the pages go to a
``PageSink`` in order, in chunks of whole pages.

Memory is bounded: the socket is read into a pool of at most ``buffers`` chunks of ``chunk``
bytes (allocated as needed, so a small dump takes little), handed to the sink on a second
thread. A chunk is filled with the pages of as many consecutive entries of one image as fit
(images of many small runs, e.g. memory with zero pages between, would otherwise take a
chunk and a sink call per run); messages are read in bulk through a read buffer
(``READ_AHEAD``), and only the pages of a large entry straight into their chunk. While the
sink keeps up, CRIU never waits; when it is slower the pool absorbs the difference, and once
it is full CRIU waits on the socket (back-pressure): at most ``buffers * chunk`` bytes of
pages are held here whatever the dump's size (the store's sink spills instead of making
CRIU wait: ``core.store.streaming``).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ckptd.core.ports import PageSink

try:
    from ckptd._pages import ps_entries as _native_entries
except ImportError:  # not built: every message takes the Python path
    _native_entries = None  # type: ignore[assignment]

PAGE_SIZE = 4096
IOV_41 = struct.Struct("<IIQQ")
"""CRIU 4.1's ``page_server_iov {u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id}``."""
IOV = struct.Struct("<I4xQQQ")
"""CRIU 4.2's: ``nr_pages`` became a u64 (the struct is padded after ``cmd``)."""

PS_IOV_ADD, PS_IOV_HOLE, PS_IOV_OPEN, PS_IOV_OPEN2, PS_IOV_PARENT, PS_IOV_ADD_F = 1, 2, 3, 4, 5, 6
PS_IOV_GET = 7
PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 0x1023, 0x1024
PS_TYPE_PID, PS_TYPE_SHMEM = 1, 2
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025

DEFAULT_CHUNK = 4 << 20
READ_AHEAD = 1 << 20
"""The receive buffer messages are parsed from (one ``recv`` reads many small entries)."""
DEFAULT_BUFFERS = 16
"""With DEFAULT_CHUNK, 64 MiB. The sink never makes CRIU wait for ingest (the store's spills
what it cannot take at once, ADR 0021), so the pool only absorbs the jitter of handing chunks
over and of the spill's writes; it was 256 MiB while ingest itself paced CRIU, and with
``StreamedPages``'s own (at most about 164 MiB) and the page index it took a 4 GiB dump over
the 512 MiB a dump may take (issue 25: docs/performance/speed.md)."""


class PageServerError(Exception):
    """CRIU spoke something this receiver does not accept, or the sink failed."""


@dataclass
class ReceiverStats:
    images: list[str] = field(default_factory=list)
    """Every image written or handed to the sink, pagemaps and pages, in order."""
    pages: int = 0
    entries: int = 0
    bytes_received: int = 0
    peak_buffers: int = 0
    """The most chunks in flight at once (each ``chunk`` bytes)."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _pb_entry(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def pagemap_head(pages_id: int) -> bytes:
    """``pagemap_head { pages_id }`` framed as CRIU frames an image entry."""
    return _pb_entry(b"\x08" + _varint(pages_id))


def pagemap_entry(vaddr: int, nr_pages: int, flags: int) -> bytes:
    """``pagemap_entry`` framed as CRIU 4.2 writes it: ``vaddr`` (1), the required
    ``compat_nr_pages`` (2) left 0, ``flags`` (4), ``nr_pages`` (5, a u64 now)."""
    return _pb_entry(b"\x08" + _varint(vaddr) + b"\x10\x00" + b"\x20" + _varint(flags)
                     + b"\x28" + _varint(nr_pages))


def pagemap_entry_41(vaddr: int, nr_pages: int, flags: int) -> bytes:
    """``pagemap_entry { vaddr, nr_pages, flags }`` framed as CRIU 4.1 writes it."""
    return _pb_entry(b"\x08" + _varint(vaddr) + b"\x10" + _varint(nr_pages)
                     + b"\x20" + _varint(flags))


@dataclass(frozen=True)
class Wire:
    """One CRIU version's page-server message and pagemap entry layout."""

    iov: struct.Struct
    entry: Callable[[int, int, int], bytes]
    v42: bool
    """4.2's layouts (``ckptd._pages.ps_entries`` speaks both)."""


WIRE_42 = Wire(IOV, pagemap_entry, True)
WIRE_41 = Wire(IOV_41, pagemap_entry_41, False)


def wire_for(criu_version: str) -> Wire:
    """The layout of CRIU ``criu_version`` ("4.1.1", "4.2.1"; 4.2's when unknown)."""
    parts = [int(p) for p in criu_version.split(".")[:2] if p.isdigit()]
    return WIRE_41 if len(parts) == 2 and tuple(parts) < (4, 2) else WIRE_42


def pagemap_name(dst_id: int) -> str:
    kind, image_id = dst_id & 0xFF, dst_id >> 8
    if kind == PS_TYPE_PID:
        return f"pagemap-{image_id}.img"
    if kind == PS_TYPE_SHMEM:
        return f"pagemap-shmem-{image_id}.img"
    raise PageServerError(f"unknown pagemap type {kind} (dst_id {dst_id:#x})")


class _Image:
    """One open pagemap and its pages image."""

    def __init__(self, images_dir: Path, dst_id: int, pages_id: int) -> None:
        self.dst_id = dst_id
        self.pagemap = images_dir / pagemap_name(dst_id)
        self.pages_name = f"pages-{pages_id}.img"
        self.size = 0
        self.fh = open(self.pagemap, "wb")  # noqa: SIM115 - closed by close()
        self.fh.write(struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC))
        self.fh.write(pagemap_head(pages_id))

    def close(self) -> None:
        self.fh.close()


_END = object()


class PageServer:
    """Receive one dump's pages. Use: ``criu_end()`` goes to CRIU as ``opts.ps.fd`` (passed to
    its process), ``start()`` before the dump request, ``wait()`` after CRIU has answered.
    ``images_dir`` gets the pagemap images; ``sink`` the pages."""

    def __init__(
        self, images_dir: Path, sink: PageSink, *, chunk: int = DEFAULT_CHUNK,
        buffers: int = DEFAULT_BUFFERS, wire: Wire = WIRE_42,
    ) -> None:
        self._wire = wire
        if chunk % PAGE_SIZE or chunk <= 0 or buffers < 1:
            raise ValueError("chunk must be a positive multiple of the page size; buffers >= 1")
        self._dir = images_dir
        self._sink = sink
        self._chunk = chunk
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):  # fewer, larger wake-ups; capped by wmem_max
            self._theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._chunk_buf: bytearray | None = None
        """The chunk being filled: ``_chunk_fill`` bytes, at ``_chunk_at`` in its image."""
        self._chunk_fill = 0
        self._chunk_at = 0
        self._rbuf = bytearray()
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        self._allocated = 0
        self._buffers = buffers
        self._work: queue.Queue[object] = queue.Queue()
        self.stats = ReceiverStats()
        self._error: BaseException | None = None
        self._sink_error: BaseException | None = None
        self._receiver = threading.Thread(target=self._receive_main, name="ps-recv", daemon=True)
        self._delivery = threading.Thread(target=self._deliver_main, name="ps-sink", daemon=True)

    def criu_end(self) -> socket.socket:
        """CRIU's end of the socket (close it here once CRIU has been started)."""
        return self._theirs

    def start(self) -> None:
        self._receiver.start()
        self._delivery.start()

    def close_criu_end(self) -> None:
        self._theirs.close()

    def wait(self, timeout: float | None = None) -> ReceiverStats:
        """Wait until CRIU closed the session and the sink has had every page; raises
        ``PageServerError`` if the session was not completed or the sink failed."""
        self._receiver.join(timeout)
        self._delivery.join(timeout)
        if self._receiver.is_alive() or self._delivery.is_alive():
            raise PageServerError("the page server did not finish in time")
        error = self._sink_error or self._error
        if error is not None:
            raise PageServerError(f"page server: {error}") from error
        return self.stats

    def abort(self) -> None:
        """End the session now (CRIU, if still sending, fails on the socket)."""
        with contextlib.suppress(OSError):
            self._ours.shutdown(socket.SHUT_RDWR)

    # ---- receiving ------------------------------------------------------------------------

    def _receive_main(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self._error = exc
            with contextlib.suppress(OSError):
                self._ours.shutdown(socket.SHUT_RDWR)  # CRIU, still sending, fails
        finally:
            self._ours.close()
            self._work.put(_END)

    def _fill(self, need: int) -> None:
        """At least ``need`` unread bytes in the read buffer (``need`` <= READ_AHEAD)."""
        while self._rend - self._rpos < need:
            if self._rpos and self._rpos == self._rend:
                self._rpos = self._rend = 0
            elif self._rpos and len(self._rbuf) - self._rpos < need:  # keep it contiguous
                left = self._rend - self._rpos
                self._rbuf[:left] = self._rbuf[self._rpos : self._rend]
                self._rpos, self._rend = 0, left
            n = self._ours.recv_into(self._rview[self._rend :])
            if n == 0:
                raise PageServerError("CRIU closed the page-server socket mid-message"
                                      if self._rend > self._rpos else
                                      "CRIU closed the page-server socket without CLOSE")
            self._rend += n

    def _read_into(self, view: memoryview) -> None:
        """Fill ``view``: what the read buffer holds first, the rest straight from the
        socket."""
        have = min(self._rend - self._rpos, len(view))
        if have:
            view[:have] = self._rview[self._rpos : self._rpos + have]
            self._rpos += have
        got = have
        while got < len(view):
            n = self._ours.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if n == 0:
                raise PageServerError("CRIU closed the page-server socket mid-message")
            got += n

    def _serve(self) -> None:
        iov = self._wire.iov
        self._rbuf = bytearray(READ_AHEAD)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        image: _Image | None = None
        next_pages_id = 1
        try:
            while True:
                if image is not None:
                    self._take_entries(image)
                self._fill(iov.size)
                cmd_word, nr_pages, vaddr, dst_id = iov.unpack_from(self._rbuf, self._rpos)
                self._rpos += iov.size
                cmd, flags = cmd_word & 0xFFFF, cmd_word >> 16
                if cmd in (PS_IOV_OPEN, PS_IOV_OPEN2):
                    self._close_image(image)
                    image = _Image(self._dir, dst_id, next_pages_id)
                    next_pages_id += 1
                    self.stats.images.append(image.pagemap.name)
                    self._work.put(("begin", image.pages_name))
                    if cmd == PS_IOV_OPEN2:
                        self._ours.sendall(b"\x00")  # no parent
                elif cmd == PS_IOV_PARENT:
                    self._ours.sendall(struct.pack("<i", 0))
                elif cmd in (PS_IOV_ADD_F, PS_IOV_ADD, PS_IOV_HOLE):
                    if cmd == PS_IOV_ADD:
                        flags = PE_PRESENT
                    elif cmd == PS_IOV_HOLE:
                        flags = PE_PARENT
                    if image is None or image.dst_id != dst_id:
                        raise PageServerError(f"pages for {dst_id:#x} without OPEN")
                    image.fh.write(self._wire.entry(vaddr, nr_pages, flags))
                    self.stats.entries += 1
                    if flags & PE_PRESENT:
                        self._receive_pages(image, nr_pages * PAGE_SIZE)
                elif cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    self._close_image(image)
                    image = None
                    self._drain()
                    status = 0 if self._sink_error is None else -1
                    self._ours.sendall(struct.pack("<i", status))
                    if status:
                        raise PageServerError("the sink failed") from self._sink_error
                    return
                else:
                    raise PageServerError(f"unexpected page-server command {cmd_word:#x}")
        finally:
            if image is not None:
                image.close()  # idempotent: a failed session leaves no open file
            self._chunk_buf = None

    def _take_entries(self, image: _Image) -> None:
        """The run of page messages of ``image`` already whole in the read buffer, taken in
        one native call without the GIL (``ckptd._pages.ps_entries``: pages copied into the
        current chunk while they fit, pagemap entries encoded as ``_serve`` would), instead
        of one pass of ``_serve``'s loop each (~15 µs of Python an entry, on CRIU's path: a
        job's memory in short runs has tens of thousands). What it leaves, ``_serve`` takes."""
        chunk = self._chunk_buf
        if (_native_entries is None or chunk is None or self._sink_error is not None
                or self._rend - self._rpos < self._wire.iov.size):
            return
        rpos, fill, entries, count, pages = _native_entries(
            self._rbuf, self._rpos, self._rend, chunk, self._chunk_fill, image.dst_id,
            self._wire.v42)
        if not count:
            return
        image.fh.write(entries)
        took = fill - self._chunk_fill
        self._rpos, self._chunk_fill = rpos, fill
        image.size += took
        self.stats.entries += count
        self.stats.pages += pages
        self.stats.bytes_received += took
        if fill == len(chunk):
            self._hand_off(image)

    def _receive_pages(self, image: _Image, length: int) -> None:
        """The entry's pages into the image's current chunk (handed to the sink once full,
        or at the image's end)."""
        while length:
            if self._sink_error is not None:
                raise PageServerError("the sink failed") from self._sink_error
            if self._chunk_buf is None:
                self._chunk_buf = self._buffer()
                self._chunk_fill = 0
                self._chunk_at = image.size
                self.stats.peak_buffers = max(self.stats.peak_buffers,
                                              self._allocated - self._free.qsize())
            buf = self._chunk_buf
            take = min(length, len(buf) - self._chunk_fill)
            self._read_into(memoryview(buf)[self._chunk_fill : self._chunk_fill + take])
            self._chunk_fill += take
            image.size += take
            length -= take
            self.stats.pages += take // PAGE_SIZE
            self.stats.bytes_received += take
            if self._chunk_fill == len(buf):
                self._hand_off(image)

    def _hand_off(self, image: _Image) -> None:
        """The current chunk, if any, to the sink."""
        if self._chunk_buf is not None:
            self._work.put(("pages", image.pages_name, self._chunk_at, self._chunk_buf,
                            self._chunk_fill))
            self._chunk_buf = None

    def _buffer(self) -> bytearray:
        """A free chunk: a returned one, else a new one while fewer than ``buffers`` exist,
        else the next one the sink returns (CRIU waits meanwhile)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self._allocated < self._buffers:
                self._allocated += 1
                return bytearray(self._chunk)
        return self._free.get()

    def _close_image(self, image: _Image | None) -> None:
        if image is not None:
            self._hand_off(image)
            image.close()
            self._work.put(("end", image.pages_name, image.size))
            self.stats.images.append(image.pages_name)

    def _drain(self) -> None:
        """Wait until the sink has had everything queued so far."""
        done = threading.Event()
        self._work.put(("mark", done))
        done.wait()

    # ---- delivering -----------------------------------------------------------------------

    def _deliver_main(self) -> None:
        while True:
            item = self._work.get()
            if item is _END:
                return
            assert isinstance(item, tuple)
            kind = item[0]
            if kind == "mark":
                item[1].set()
                continue
            if kind == "pages":
                buf = item[3]
                try:
                    if self._sink_error is None:
                        with memoryview(buf) as view:
                            self._sink.pages(item[1], item[2], view[: item[4]])
                except BaseException as exc:
                    self._sink_error = exc
                finally:
                    self._free.put(buf)
                continue
            try:
                if self._sink_error is None:
                    if kind == "begin":
                        self._sink.begin_image(item[1])
                    else:
                        self._sink.end_image(item[1], item[2])
            except BaseException as exc:
                self._sink_error = exc


class FileSink:
    """A ``PageSink`` that writes each pages image to a directory (tests, and CRIU's image
    directory rebuilt whole)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._open: dict[str, BinaryIO] = {}

    def begin_image(self, name: str) -> None:
        self._open[name] = open(self._dir / name, "wb")  # noqa: SIM115

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        self._open[name].write(data)

    def end_image(self, name: str, size: int) -> None:
        self._open.pop(name).close()
