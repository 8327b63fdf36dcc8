"""Pack objects: many pages in frames, with a trailer that names every page.

Layout::

    b"CKPACK01"
    frame 0 .. frame F-1              each: up to FRAME_PAGES pages, concatenated, either
                                      a zstd frame, an LZ4 frame or the pages as they are
    trailer (zstd-compressed):
        u32 F
        F x (u64 offset, u32 length, u32 pages)
        for each frame, its pages' hashes (16 bytes each), in order
    u64 trailer offset, u32 trailer length, 8 bytes xxh3-64 of the trailer, b"CKPKEND1"

A frame of exactly ``pages * PAGE_SIZE`` bytes holds its pages as they are (*raw*: they did
not compress, docs/adr/0012-native-page-path.md); any other length is a compressed frame,
zstd or LZ4 (its magic number says which: ``pagepath.Compression``, ADR 0029). Writers
since raw frames exist never store a zstd frame that long (``compress_frame`` keeps one only
when it is strictly shorter). Packs written before (every frame zstd) read unchanged: a zstd
frame of exactly that length is possible there only in contrived cases (zstd keeps a
compressed block only when it saves more than 1/64 of it, more than a frame's headers unless
that block is one page), and if one is met, reading it as raw fails verification, so a frame
of that length that does not verify and starts with the zstd magic number is decompressed
instead (then verified as usual). The trailer is unchanged.

A pack is immutable and named by the xxh3-128 of its bytes. The trailer alone rebuilds the
index of every page in it. Invariant: every page in a pack is verified against its hash when
read (``read_frame``), whether its frame is raw or compressed.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import xxhash
import zstandard

from ckptd.core.store import pagepath
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, PageHasher
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, ZSTD_MAGIC, Compression
from ckptd.errors import CorruptCheckpoint

MAGIC = b"CKPACK01"
END_MAGIC = b"CKPKEND1"
FOOTER = struct.Struct("<QI8s8s")
FRAME_ENTRY = struct.Struct("<QII")
FRAME_PAGES = 1024
TARGET_PACK_BYTES = 64 << 20
MAX_TRAILER = 64 << 20
"""Largest decompressed trailer read (4 Mi pages: far more than a pack of TARGET_PACK_BYTES
holds); a damaged one declaring more is refused before anything is allocated."""

SealedPack = tuple[str, bytes, "PackIndex"]
Frame = bytes | memoryview
"""A frame ready for its pack: zstd bytes, or pages stored as they are (maybe a view)."""


@dataclass(frozen=True)
class FrameInfo:
    offset: int
    length: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class PackIndex:
    pack_id: str
    frames: tuple[FrameInfo, ...]

    def entries(self) -> Iterator[tuple[bytes, int, int]]:
        """(page hash, frame number, index in frame) for every page."""
        for f_no, frame in enumerate(self.frames):
            for i, h in enumerate(frame.hashes):
                yield h, f_no, i


def encode_trailer(frames: Iterable[FrameInfo]) -> bytes:
    frames = list(frames)
    parts = [struct.pack("<I", len(frames))]
    parts += [FRAME_ENTRY.pack(f.offset, f.length, len(f.hashes)) for f in frames]
    parts += [b"".join(f.hashes) for f in frames]
    return zstandard.ZstdCompressor(level=3).compress(b"".join(parts))


def decode_trailer(pack_id: str, raw_trailer: bytes) -> PackIndex:
    """The index a pack's trailer holds. Every length it declares is checked against the
    bytes it has before anything is built: a damaged trailer is a CorruptCheckpoint, never a
    huge allocation (fuzzed: tests/unit/test_fuzz_parsers.py)."""
    try:
        declared = zstandard.frame_content_size(raw_trailer)
        if declared > MAX_TRAILER:
            raise CorruptCheckpoint(
                f"pack {pack_id}: unreadable trailer (declares {declared} bytes)"
            )
        data = zstandard.ZstdDecompressor().decompress(raw_trailer, max_output_size=MAX_TRAILER)
        (count,) = struct.unpack_from("<I", data, 0)
        pos = 4
        if pos + count * FRAME_ENTRY.size > len(data):
            raise struct.error(f"{count} frames in {len(data)} bytes")
        heads = []
        for _ in range(count):
            heads.append(FRAME_ENTRY.unpack_from(data, pos))
            pos += FRAME_ENTRY.size
        frames = []
        for offset, length, pages in heads:
            if pos + pages * HASH_SIZE > len(data):
                raise struct.error(f"frame of {pages} pages cut short")
            hashes = tuple(
                data[pos + i * HASH_SIZE : pos + (i + 1) * HASH_SIZE] for i in range(pages)
            )
            pos += pages * HASH_SIZE
            frames.append(FrameInfo(offset, length, hashes))
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptCheckpoint(f"pack {pack_id}: unreadable trailer ({exc})") from exc
    return PackIndex(pack_id, tuple(frames))


def parse_footer(pack_id: str, footer: bytes) -> tuple[int, int, bytes]:
    """(trailer offset, trailer length, trailer checksum) from the last FOOTER.size bytes."""
    if len(footer) != FOOTER.size:
        raise CorruptCheckpoint(f"pack {pack_id}: truncated")
    offset, length, checksum, magic = FOOTER.unpack(footer)
    if magic != END_MAGIC:
        raise CorruptCheckpoint(f"pack {pack_id}: bad end marker (truncated or overwritten)")
    return offset, length, checksum


def check_trailer(pack_id: str, raw_trailer: bytes, checksum: bytes) -> None:
    if xxhash.xxh3_64_digest(raw_trailer) != checksum:
        raise CorruptCheckpoint(f"pack {pack_id}: trailer checksum mismatch")


def read_frame_data(
    pack_id: str, frame_no: int, raw: bytes, hashes: tuple[bytes, ...], hasher: PageHasher
) -> bytes:
    """The pages of one frame, concatenated, every one verified against its hash (in one
    native call, ``pagepath``); a raw frame is returned as it is, a zstd or LZ4 frame
    decompressed."""
    size = len(hashes) * PAGE_SIZE
    expected = b"".join(hashes)
    # threads=1: a frame is at most 4 MiB, and readers verify frames in parallel
    if not hashes or len(expected) != len(hashes) * HASH_SIZE:
        raise CorruptCheckpoint(f"pack {pack_id} frame {frame_no}: malformed page hashes")
    if len(raw) == size:  # stored as they are
        bad = pagepath.verify_pages(raw, expected, hasher.seed, threads=1)
        if bad < 0:
            return raw
        if not raw.startswith(ZSTD_MAGIC):
            raise _mismatch(pack_id, frame_no, bad)
        try:  # an older writer's zstd frame exactly as long as its pages (module docstring)?
            data = _decompress(pack_id, frame_no, raw, size)
        except CorruptCheckpoint:
            raise _mismatch(pack_id, frame_no, bad) from None
    else:
        data = _decompress(pack_id, frame_no, raw, size)
    bad = pagepath.verify_pages(data, expected, hasher.seed, threads=1)
    if bad >= 0:
        raise _mismatch(pack_id, frame_no, bad)
    return data


def _decompress(pack_id: str, frame_no: int, raw: bytes, size: int) -> bytes:
    """A zstd or LZ4 frame's pages (its magic number says which), ``size`` bytes."""
    try:
        return pagepath.decompress_frame(raw, size)
    except ValueError as exc:
        raise CorruptCheckpoint(
            f"pack {pack_id} frame {frame_no}: does not decompress ({exc})"
        ) from exc


def _mismatch(pack_id: str, frame_no: int, page: int) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"pack {pack_id} frame {frame_no} page {page}: content does not match its hash"
    )


def read_frame(
    pack_id: str, frame_no: int, raw: bytes, hashes: tuple[bytes, ...], hasher: PageHasher
) -> list[bytes]:
    """``read_frame_data``, the pages one by one."""
    data = read_frame_data(pack_id, frame_no, raw, hashes, hasher)
    return [data[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(len(hashes))]


def build_pack(frames: Sequence[tuple[Future[Frame], tuple[bytes, ...]]]) -> SealedPack:
    """Assemble frames (waiting for them) into a pack object: one native call copies them
    together and names the pack (``pagepath.concat_digest``)."""
    pack_id, parts, pack_index = build_pack_parts(frames)
    return pack_id, b"".join(parts), pack_index


def build_pack_parts(
    frames: Sequence[tuple[Future[Frame], tuple[bytes, ...]]],
) -> tuple[str, list[Frame], PackIndex]:
    """A pack object as its parts in order (magic, frames, trailer, footer), named without
    joining them (``pagepath.digest_parts``): for ``BlobStore.put_parts``, which writes them
    as they are. Waits for the frames to be compressed."""
    body: list[Frame] = [MAGIC]
    offset = len(MAGIC)
    infos = []
    for future, hashes in frames:
        frame = future.result()
        length = memoryview(frame).nbytes
        infos.append(FrameInfo(offset, length, hashes))
        body.append(frame)
        offset += length
    trailer = encode_trailer(infos)
    body.append(trailer)
    body.append(FOOTER.pack(offset, len(trailer), xxhash.xxh3_64_digest(trailer), END_MAGIC))
    pack_id = pagepath.digest_parts(body).hex()
    return pack_id, body, PackIndex(pack_id, tuple(infos))


@contextlib.contextmanager
def idle_priority(idle: bool = True) -> Iterator[None]:
    """The calling thread at Linux's idle scheduling class (``SCHED_IDLE``) inside, back to
    the normal one after; nothing when ``idle`` is False (or where the class is refused)."""
    if not idle:
        yield
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class PackBuilder:
    """Accumulates new pages into frames, compresses frames on ``executor`` (``pagepath.
    compress_frame``: without the GIL, so frames compress in parallel; a frame that does not
    compress is stored as it is), and groups them into packs of about
    TARGET_PACK_BYTES (``take_sealed`` hands out each group; ``build_pack`` assembles one,
    typically on another thread, so the caller never waits for compression).

    Pages come in runs of consecutive pages of one buffer (``add_run``, or many at once with
    ``add_runs``). A frame made of a single run is compressed straight from that buffer,
    without a copy, and if it does not compress it *is* that buffer until ``build_pack``
    copies it into its pack; frames of several runs of ``add_runs`` are gathered from it on
    the executor: so the buffer must outlive the packs of its pages.
    """

    def __init__(
        self,
        executor: Executor,
        compression: Compression = DEFAULT_COMPRESSION,
        target_bytes: int = TARGET_PACK_BYTES,
    ) -> None:
        self._executor = executor
        self._compression = compression
        self.compress_cpu_s = 0.0
        """CPU seconds the executor's threads spent compressing this builder's frames (and
        gathering their pages), summed over threads (the profile: docs/performance)."""
        self._cpu_lock = threading.Lock()
        self.idle = False
        """While True, frames are compressed at the idle scheduling class (``idle_priority``:
        only CPU time nobody else wants, so a tree's freeze is never lengthened by it)."""
        self._target = target_bytes
        self._pending: list[memoryview] = []
        self._pending_hashes: list[bytes] = []
        self._frames: list[tuple[Future[Frame], tuple[bytes, ...]]] = []
        self._inflight: list[Future[Frame]] = []
        self._bytes_in = 0
        self._sealed: list[list[tuple[Future[Frame], tuple[bytes, ...]]]] = []

    def add(self, page_hash: bytes, page: bytes | memoryview) -> None:
        self.add_run([page_hash], memoryview(page))

    def add_run(self, hashes: list[bytes], data: memoryview) -> None:
        """Queue ``len(hashes)`` consecutive pages held in ``data``."""
        done = 0
        while done < len(hashes):
            room = FRAME_PAGES - len(self._pending_hashes)
            take = min(room, len(hashes) - done)
            self._pending.append(data[done * PAGE_SIZE : (done + take) * PAGE_SIZE])
            self._pending_hashes.extend(hashes[done : done + take])
            done += take
            if len(self._pending_hashes) >= FRAME_PAGES:
                self.cut_frame()

    def add_runs(
        self,
        hashes: Sequence[bytes],
        pages: memoryview,
        runs: Iterable[tuple[int, int]],
        *,
        in_runs: bool = False,
    ) -> None:
        """Queue the pages of every run (first page, count) of ``pages``, page i having hash
        ``hashes[i]``; ``in_runs``: ``hashes`` has only the runs' pages', in order
        (``pagepath.plan_runs``). A frame made of several runs is gathered
        (``pagepath.gather_pages``, one native copy) on the executor, just before its
        compression: no Python object per page, nor per run beyond the run itself."""
        self.cut_frame()  # a frame of runs holds pages of ``pages`` only
        limit = FRAME_PAGES
        spans: list[tuple[int, int]] = []
        frame_hashes: list[bytes] = []
        at = 0  # in_runs: where the next page's hash is
        for run_first, run_count in runs:
            first, count = run_first, run_count
            while count:
                take = min(count, limit - len(frame_hashes))
                spans.append((first, take))
                if in_runs:
                    frame_hashes.extend(hashes[at : at + take])
                    at += take
                else:
                    frame_hashes.extend(hashes[first : first + take])
                first, count = first + take, count - take
                if len(frame_hashes) == limit:
                    self._queue_spans(pages, spans, frame_hashes)
                    spans, frame_hashes = [], []
        if spans:
            self._queue_spans(pages, spans, frame_hashes)

    def _queue_spans(
        self, pages: memoryview, spans: list[tuple[int, int]], hashes: list[bytes]
    ) -> None:
        if len(spans) == 1:
            first, count = spans[0]
            data = pages[first * PAGE_SIZE : (first + count) * PAGE_SIZE]
            self._queue(self._executor.submit(self._compress, data), hashes)
        else:
            self._queue(self._executor.submit(self._compress, pages, spans), hashes)

    def _compress(
        self, data: bytes | memoryview, spans: list[tuple[int, int]] | None = None
    ) -> Frame:
        """``data`` (with ``spans``: those runs of its pages, gathered first) as a frame, on
        the executor; its CPU time counted in ``compress_cpu_s``."""
        began = time.thread_time()
        try:
            with idle_priority(self.idle):
                if spans is not None:
                    data = pagepath.gather_pages(data, spans)
                return pagepath.compress_frame(data, self._compression)
        finally:
            spent = time.thread_time() - began
            with self._cpu_lock:
                self.compress_cpu_s += spent

    def add_frame(self, frame: Frame, hashes: Sequence[bytes]) -> None:
        """Queue a frame already made (compressed or raw, its pages verified by the caller)
        as it is: no recompression (compaction copies whole live frames this way)."""
        self.cut_frame()
        done: Future[Frame] = Future()
        done.set_result(frame)
        self._queue(done, list(hashes))

    def cut_frame(self) -> None:
        if not self._pending:
            return
        data: bytes | memoryview = (
            self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        )
        self._queue(self._executor.submit(self._compress, data), self._pending_hashes)
        self._pending, self._pending_hashes = [], []

    def _queue(self, future: Future[Frame], hashes: list[bytes]) -> None:
        self._frames.append((future, tuple(hashes)))
        self._inflight.append(future)
        self._bytes_in += len(hashes) * PAGE_SIZE
        # Raw bytes are a cheap proxy for the pack size until frames are compressed.
        if self._bytes_in >= self._target * 2:
            self._seal()

    def drain(self) -> None:
        """Cut the pending frame and wait until every frame is compressed: after this, no
        buffer given to ``add_run`` is referenced any more."""
        self.cut_frame()
        for future in self._inflight:
            future.exception()
        self._inflight = []

    def compressing(self) -> int:
        """How many frames are still being compressed (never waits)."""
        return sum(not future.done() for future in self._inflight)

    def throttle(self, max_frames: int) -> None:
        """Wait until at most ``max_frames`` frames are still compressing (bounds the memory
        of a producer faster than compression)."""
        while len(self._inflight) > max_frames:
            self._inflight.pop(0).exception()

    def _seal(self) -> None:
        if self._frames:
            self._sealed.append(self._frames)
        self._frames = []
        self._bytes_in = 0

    def finish(self) -> None:
        self.cut_frame()
        self._seal()

    def take_sealed(self) -> list[list[tuple[Future[Frame], tuple[bytes, ...]]]]:
        """Frame groups ready to become packs (pass each to ``build_pack``)."""
        out, self._sealed = self._sealed, []
        return out
