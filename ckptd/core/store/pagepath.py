"""The store's per-page data path: hashing, zero detection, dedup planning, frame compression,
verification and writing pages out, in C (``ckptd._pages``: no GIL, big buffers split over
every CPU) or, only when that extension could not be built, the same in pure Python (slow: the
store says so once in its log). docs/adr/0012-native-page-path.md.

Both paths give identical results (tests/unit/store/test_pagepath.py runs them against each
other); ``compress_frame`` may decide differently between compressing and storing as it is
(a sample against the whole frame), and both decisions read back the same pages.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import xxhash
import zstandard

from ckptd.core.store import pagelist
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_PAGE, ZERO_REF

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

GIL_CHUNK = 1 << 16
"""Pages per native call of the steps that hold the GIL (``plan_new``, ``code_runs``: a few
ms each), so that a huge image does not keep the daemon's other threads waiting."""

try:
    from ckptd import _pages as _native
except ImportError:  # not built: no compiler, libzstd-dev or libxxhash-dev at install time
    _native = None  # type: ignore[assignment]


CodecName = Literal["zstd", "lz4"]
CODECS: tuple[CodecName, ...] = ("zstd", "lz4")
LEVELS: dict[str, tuple[int, int]] = {"zstd": (-50, 19), "lz4": (-50, 12)}
"""Levels accepted per codec: zstd's own (1 as ``zstd -1``, negative its ``--fast=N``
levels), LZ4F's (0 its default fast mode, negative its acceleration, 3-12 its slow HC)."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LZ4_MAGIC = b"\x04\x22\x4d\x18"


@dataclass(frozen=True)
class Compression:
    """How new page frames are compressed: ``codec`` and its ``level`` (``LEVELS``).

    Readers never need it: a frame says what it is (its codec's magic number, or its length
    for pages stored as they are: packs.py), so frames of both codecs read from any store."""

    codec: CodecName = "zstd"
    level: int = 1

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"compression codec {self.codec!r} must be one of "
                             + ", ".join(CODECS))
        low, high = LEVELS[self.codec]
        if not low <= self.level <= high:
            raise ValueError(f"{self.codec} level {self.level} must be in [{low}, {high}]")

    def __str__(self) -> str:
        return f"{self.codec} level {self.level}"


DEFAULT_COMPRESSION = Compression()


def is_native() -> bool:
    return _native is not None


@functools.cache
def warn_if_slow() -> None:
    """Log once per process that the data path runs in Python, if it does."""
    if _native is None:
        log.warning(
            "ckptd._pages is not built: pages are hashed, compressed and verified in Python "
            "(several times slower, one core); install libzstd-dev and libxxhash-dev and run "
            "pip install -e . (scripts/setup.sh does both)"
        )


def hash_pages(buffer: Buffer, seed: int, *, zero_ref: bool = False) -> bytes:
    """The xxh3-128 of every 4 KiB page of ``buffer`` (a whole number of pages) with
    ``seed``, concatenated, as ``xxhash.xxh3_128_digest`` gives it. ``zero_ref``: a page of
    zeros gives ZERO_REF (and is not hashed)."""
    if _native is not None:
        return _native.hash_pages(buffer, seed, zero_ref=zero_ref)
    return py_hash_pages(buffer, seed, zero_ref=zero_ref)


def verify_pages(buffer: Buffer, hashes: Buffer, seed: int, *, threads: int = 0) -> int:
    """The index of the first page of ``buffer`` whose hash is not its 16 bytes in
    ``hashes``; -1 if every page matches. ``threads``: 0 splits a big buffer over the CPUs;
    1 for one frame among many already verified in parallel."""
    if _native is not None:
        return _native.verify_pages(buffer, hashes, seed, threads=threads)
    return py_verify_pages(buffer, hashes, seed)


def plan_new(
    refs: Buffer, known: Container[bytes], fresh: set[bytes]
) -> tuple[list[bytes], list[tuple[int, int]]]:
    """``refs`` (16 bytes each) as a list, and the runs (first, count) of consecutive pages
    to store: not ZERO_REF, not ``in known``, not in ``fresh`` nor earlier in ``refs`` (each
    one planned is added to ``fresh``)."""
    if _native is None:
        return py_plan_new(refs, known, fresh)
    view = memoryview(refs).cast("B")
    if len(view) % HASH_SIZE:
        raise ValueError(f"references of {len(view)} bytes are not a whole number")
    out: list[bytes] = []
    runs: list[tuple[int, int]] = []
    step = GIL_CHUNK * HASH_SIZE
    for at in range(0, len(view), step):  # the GIL may pass to other threads between chunks
        part, part_runs = _native.plan_new(view[at : at + step], known, fresh, at // HASH_SIZE)
        if runs and part_runs and sum(runs[-1]) == part_runs[0][0]:  # a run across chunks
            runs[-1] = (runs[-1][0], runs[-1][1] + part_runs[0][1])
            del part_runs[0]
        out += part
        runs += part_runs
    return out, runs


def plan_runs(
    refs: Buffer, known: Container[bytes], fresh: set[bytes]
) -> tuple[list[bytes], list[tuple[int, int]]]:
    """``plan_new`` without the list of every reference: the references of the pages to
    store only (the runs' pages, in order: the same objects as added to ``fresh``), and the
    runs. Planned GIL_CHUNK pages at a time, so at most that many references exist as
    objects at once besides the new ones (issue #13: a page list stays ``refs``, 16 bytes
    a page)."""
    view = memoryview(refs).cast("B")
    if len(view) % HASH_SIZE:
        raise ValueError(f"references of {len(view)} bytes are not a whole number")
    plan = _native.plan_new if _native is not None else _py_plan_new_at
    new: list[bytes] = []
    runs: list[tuple[int, int]] = []
    step = GIL_CHUNK * HASH_SIZE
    for at in range(0, len(view), step):
        first = at // HASH_SIZE
        part, part_runs = plan(view[at : at + step], known, fresh, first)
        new += [part[i - first] for start, count in part_runs for i in range(start, start + count)]
        if runs and part_runs and sum(runs[-1]) == part_runs[0][0]:  # a run across chunks
            runs[-1] = (runs[-1][0], runs[-1][1] + part_runs[0][1])
            del part_runs[0]
        runs += part_runs
    return new, runs


def _py_plan_new_at(
    refs: Buffer, known: Container[bytes], fresh: set[bytes], start: int
) -> tuple[list[bytes], list[tuple[int, int]]]:
    out, runs = py_plan_new(refs, known, fresh)
    return out, [(first + start, count) for first, count in runs]


def slot_counts(buffers: Sequence[Buffer], pages: dict[bytes, int]) -> dict[int, int]:
    """For the references (16 bytes each) of all ``buffers`` found in ``pages`` (an index's
    hash -> code), how many distinct codes (so distinct pages) each slot (``code >> 32``)
    has: a checkpoint's footprint, in one native pass with no object per page (a sort of 8
    bytes a located page)."""
    if _native is not None:
        return _native.slot_counts(buffers, pages)
    return py_slot_counts(buffers, pages)


def encode_delta(refs: bytes | bytearray, base: bytes | bytearray, base_hash: bytes) -> bytes:
    """``pagelist.encode_delta`` (the same bytes) of packed references against a packed full
    list: natively with a table of 4 bytes a slot, no object per page (issue #13)."""
    if _native is not None:
        return _native.encode_delta(refs, base, base_hash)
    return pagelist.encode_delta(pagelist.Refs(refs), pagelist.Refs(base), base_hash)


def compress_frame(
    data: bytes | memoryview, compression: Compression = DEFAULT_COMPRESSION
) -> bytes | memoryview:
    """A zstd or LZ4 frame (``compression``) of ``data`` (whole pages), strictly shorter than
    it; or, when it does not compress, ``data`` itself (no copy here: its pack copies it;
    exactly ``len(data)`` bytes: how a reader tells them apart, packs.py)."""
    if _native is not None:
        codec = _native.CODEC_LZ4 if compression.codec == "lz4" else _native.CODEC_ZSTD
        frame = _native.compress_frame(data, compression.level, codec)
        return data if frame is None else frame
    return py_compress_frame(data, compression)


def decompress_frame(frame: Buffer, size: int) -> bytes:
    """A zstd or LZ4 frame (told apart by their magic numbers) decompressed: exactly
    ``size`` bytes, else ``ValueError`` saying what is wrong (without the GIL, natively)."""
    if _native is not None:
        return _native.decompress_frame(frame, size)
    return py_decompress_frame(frame, size)


def concat_digest(parts: Sequence[Buffer]) -> tuple[bytes, bytes]:
    """``parts`` concatenated, and the xxh3-128 (unseeded) of the result: a pack and its
    name."""
    if _native is not None:
        return _native.concat_digest(parts)
    return py_concat_digest(parts)


def digest_parts(parts: Sequence[Buffer]) -> bytes:
    """The xxh3-128 (unseeded) of ``parts`` as if concatenated (``concat_digest``'s name),
    without concatenating them."""
    if _native is not None:
        return _native.digest_parts(parts)
    return py_digest_parts(parts)


def code_runs(
    codes: Sequence[int | None], refs: Sequence[bytes]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """A restore's plan from the index's codes of ``refs`` (``PageIndex.locate``): the runs
    (position, first code, count) of consecutive codes (consecutive pages of one frame), and
    the positions of pages not located (code None) that are not ZERO_REF."""
    if _native is None:
        return py_code_runs(codes, refs)
    if len(codes) != len(refs):
        raise ValueError("as many codes as references")
    runs: list[tuple[int, int, int]] = []
    missing: list[int] = []
    for at in range(0, len(codes), GIL_CHUNK):  # the GIL may pass between chunks
        part_runs, part_missing = _native.code_runs(
            codes[at : at + GIL_CHUNK], refs[at : at + GIL_CHUNK], at
        )
        runs += part_runs  # a run across chunks stays two runs: two writes, same pages
        missing += part_missing
    return runs, missing


def gather_pages(buffer: Buffer, runs: Sequence[tuple[int, int]]) -> bytes:
    """The pages of each run (first page, count) of ``buffer``, concatenated."""
    if _native is not None:
        return _native.gather_pages(buffer, runs)
    return py_gather_pages(buffer, runs)


def write_runs(fd: int, buffer: Buffer, runs: Sequence[tuple[int, int, int]]) -> None:
    """Write each run (page in the file, page in ``buffer``, count) of ``buffer``'s pages
    at its place in ``fd``."""
    if _native is not None:
        _native.write_runs(fd, buffer, runs)
    else:
        py_write_runs(fd, buffer, runs)


# ---- pure Python (the fallback, and the reference the tests hold the C against) ----------


def _pages(buffer: Buffer) -> memoryview:
    view = memoryview(buffer).cast("B")
    if len(view) % PAGE_SIZE:
        raise ValueError(f"buffer of {len(view)} bytes is not a whole number of pages")
    return view


def py_hash_pages(buffer: Buffer, seed: int, *, zero_ref: bool = False) -> bytes:
    view = _pages(buffer)
    digest = xxhash.xxh3_128_digest
    out = []
    for off in range(0, len(view), PAGE_SIZE):
        page = view[off : off + PAGE_SIZE]
        out.append(ZERO_REF if zero_ref and page == ZERO_PAGE else digest(page, seed=seed))
    return b"".join(out)


def py_verify_pages(buffer: Buffer, hashes: Buffer, seed: int) -> int:
    view, want = _pages(buffer), bytes(hashes)
    if len(want) != len(view) // PAGE_SIZE * HASH_SIZE:
        raise ValueError(f"{len(view) // PAGE_SIZE} pages but {len(want)} bytes of hashes")
    digest = xxhash.xxh3_128_digest
    for i in range(len(view) // PAGE_SIZE):
        page = view[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        if digest(page, seed=seed) != want[i * HASH_SIZE : (i + 1) * HASH_SIZE]:
            return i
    return -1


def py_plan_new(
    refs: Buffer, known: Container[bytes], fresh: set[bytes]
) -> tuple[list[bytes], list[tuple[int, int]]]:
    raw = bytes(refs)
    if len(raw) % HASH_SIZE:
        raise ValueError(f"references of {len(raw)} bytes are not a whole number")
    out = [raw[i : i + HASH_SIZE] for i in range(0, len(raw), HASH_SIZE)]
    runs: list[tuple[int, int]] = []
    first = count = 0
    for i, h in enumerate(out):
        if h == ZERO_REF or h in fresh or h in known:
            continue
        fresh.add(h)
        if count and i == first + count:
            count += 1
            continue
        if count:
            runs.append((first, count))
        first, count = i, 1
    if count:
        runs.append((first, count))
    return out, runs


def py_slot_counts(buffers: Sequence[Buffer], pages: dict[bytes, int]) -> dict[int, int]:
    codes: set[int] = set()
    for buffer in buffers:
        raw = bytes(buffer)
        if len(raw) % HASH_SIZE:
            raise ValueError(f"references of {len(raw)} bytes are not a whole number")
        for i in range(0, len(raw), HASH_SIZE):
            code = pages.get(raw[i : i + HASH_SIZE])
            if code is not None:
                codes.add(code)
    counts: dict[int, int] = {}
    for code in codes:
        counts[code >> 32] = counts.get(code >> 32, 0) + 1
    return counts


def py_compress_frame(
    data: bytes | memoryview, compression: Compression = DEFAULT_COMPRESSION
) -> bytes | memoryview:
    view = _pages(data)
    if not view:
        raise ValueError("empty frame")
    frame: bytes
    if compression.codec == "lz4":
        import lz4.frame  # only here: the native path has its own

        frame = lz4.frame.compress(view, compression_level=compression.level,
                                   block_size=lz4.frame.BLOCKSIZE_MAX4MB,
                                   content_checksum=False, store_size=True)
    else:
        frame = zstandard.ZstdCompressor(level=compression.level).compress(view)
    return frame if len(frame) < len(view) else data


def py_decompress_frame(frame: Buffer, size: int) -> bytes:
    raw = bytes(frame)
    if raw.startswith(ZSTD_MAGIC):
        try:
            declared = zstandard.frame_content_size(raw)
            if declared not in (-1, size):
                raise ValueError("its zstd header declares another size")
            if declared == -1:  # no size said: bounded (trailing bytes go unnoticed here)
                data: bytes = zstandard.ZstdDecompressor().decompress(raw, max_output_size=size)
                ended, rest = True, b""
            else:  # zstd itself holds the frame to the size it declares
                zobj = zstandard.ZstdDecompressor().decompressobj()
                data = zobj.decompress(raw)
                ended, rest = zobj.eof, zobj.unused_data
        except zstandard.ZstdError as exc:
            raise ValueError(str(exc)) from exc
    elif raw.startswith(LZ4_MAGIC):
        import lz4.frame

        try:
            info = lz4.frame.get_frame_info(raw)
            if info["content_size"] != size:
                raise ValueError("its LZ4 header declares another size")
            lobj = lz4.frame.LZ4FrameDecompressor()
            data = lobj.decompress(raw, max_length=size + 1)
            ended, rest = lobj.eof, lobj.unused_data
        except RuntimeError as exc:  # python-lz4's error for a damaged frame
            raise ValueError(str(exc)) from exc
    else:
        raise ValueError("neither a zstd nor an LZ4 frame")
    if not ended:
        raise ValueError("frame cut short")
    if rest:
        raise ValueError("bytes after the frame's end")
    if len(data) != size:
        raise ValueError(f"{len(data)} bytes where {size} were expected")
    return data


def py_concat_digest(parts: Sequence[Buffer]) -> tuple[bytes, bytes]:
    blob = b"".join(parts)
    return blob, xxhash.xxh3_128_digest(blob)


def py_digest_parts(parts: Sequence[Buffer]) -> bytes:
    state = xxhash.xxh3_128()
    for part in parts:
        state.update(part)
    return state.digest()


def py_code_runs(
    codes: Sequence[int | None], refs: Sequence[bytes]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    if len(codes) != len(refs):
        raise ValueError("as many codes as references")
    runs: list[tuple[int, int, int]] = []
    missing: list[int] = []
    i, n = 0, len(codes)
    while i < n:
        code = codes[i]
        if code is None:
            if refs[i] != ZERO_REF:
                missing.append(i)
            i += 1
            continue
        j = i + 1
        while j < n and codes[j] == code + (j - i):
            j += 1
        runs.append((i, code, j - i))
        i = j
    return runs, missing


def py_gather_pages(buffer: Buffer, runs: Sequence[tuple[int, int]]) -> bytes:
    view = _pages(buffer)
    pages = len(view) // PAGE_SIZE
    parts = []
    for first, count in runs:
        if min(first, count) < 0 or first + count > pages:
            raise ValueError(f"run ({first}, {count}) outside {pages} pages")
        parts.append(view[first * PAGE_SIZE : (first + count) * PAGE_SIZE])
    return b"".join(parts)


def py_write_runs(fd: int, buffer: Buffer, runs: Sequence[tuple[int, int, int]]) -> None:
    view = _pages(buffer)
    pages = len(view) // PAGE_SIZE
    for dst, src, count in runs:
        if min(dst, src, count) < 0 or src + count > pages:
            raise ValueError(f"run ({dst}, {src}, {count}) outside {pages} pages")
        data, offset = view[src * PAGE_SIZE : (src + count) * PAGE_SIZE], dst * PAGE_SIZE
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n
