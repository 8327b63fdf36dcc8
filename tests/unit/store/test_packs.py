"""Packs: what PackBuilder seals lists every page in its trailer and reads back exactly;
damage to a frame, the trailer or the footer is detected."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store import packs
from ckptd.core.store.index import load_pack_index, pack_key
from ckptd.core.store.packs import (
    FOOTER,
    PackBuilder,
    PackIndex,
    build_pack,
    check_trailer,
    decode_trailer,
    parse_footer,
    read_frame,
)
from ckptd.core.store.pagehash import PAGE_SIZE, PageHasher
from ckptd.errors import CorruptCheckpoint
from ckptd.testing import MemoryBlobStore

from .support import PAGE_KINDS, Backend, PageKind, make_pages

HASHER = PageHasher(b"secret", 0)
pytestmark = pytest.mark.usefixtures("data_path")  # each test on the C and the Python path
kinds = st.lists(st.sampled_from(PAGE_KINDS), max_size=600)


@pytest.fixture(scope="module")
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def build(
    executor: ThreadPoolExecutor, pages: list[bytes], runs: list[int] | None = None
) -> list[tuple[str, bytes, PackIndex]]:
    """Feed ``pages`` one by one, or (``runs``) as runs of consecutive pages of one buffer."""
    builder = PackBuilder(executor)
    if runs is None:
        for page in pages:
            builder.add(HASHER.digest(page), memoryview(page))
    else:
        buffer = memoryview(b"".join(pages))
        start = 0
        for run in [*runs, len(pages)]:
            n = min(run, len(pages) - start)
            if n:
                hashes = [HASHER.digest(p) for p in pages[start : start + n]]
                builder.add_run(hashes, buffer[start * PAGE_SIZE : (start + n) * PAGE_SIZE])
            start += n
    builder.finish()
    return [build_pack(frames) for frames in builder.take_sealed()]


def read_back(pack_id: str, blob: bytes) -> tuple[PackIndex, list[bytes]]:
    """Parse the trailer from the pack's bytes alone, then read every frame."""
    offset, length, checksum = parse_footer(pack_id, blob[-FOOTER.size :])
    raw = blob[offset : offset + length]
    check_trailer(pack_id, raw, checksum)
    index = decode_trailer(pack_id, raw)
    pages = []
    for f_no, frame in enumerate(index.frames):
        data = blob[frame.offset : frame.offset + frame.length]
        pages += read_frame(pack_id, f_no, data, frame.hashes, HASHER)
    return index, pages


def check_sealed(sealed: list[tuple[str, bytes, PackIndex]], pages: list[bytes]) -> None:
    hashes: list[bytes] = []
    got: list[bytes] = []
    for pack_id, blob, built_index in sealed:
        assert blob.startswith(packs.MAGIC)
        assert pack_id == xxhash.xxh3_128_hexdigest(blob)  # named by its content
        index, pack_pages = read_back(pack_id, blob)
        assert index == built_index
        assert all(0 < len(f.hashes) <= packs.FRAME_PAGES for f in index.frames)
        hashes += [h for h, _f, _i in index.entries()]
        got += pack_pages
    assert hashes == [HASHER.digest(p) for p in pages]
    assert got == pages


frame_sizes = st.sampled_from([0, 1, 13, 256])  # 0: FRAME_PAGES as it is
runs = st.none() | st.lists(st.integers(1, 300), max_size=8)


@settings(max_examples=30, deadline=None)
@given(kinds, st.integers(0, 2**32), frame_sizes, runs)
def test_sealed_packs_list_and_return_every_page(
    executor: ThreadPoolExecutor,
    page_kinds: list[PageKind],
    seed: int,
    frame_pages: int,
    run_lengths: list[int] | None,
) -> None:
    pages = make_pages(page_kinds, seed)
    with pytest.MonkeyPatch.context() as mp:
        if frame_pages:
            mp.setattr(packs, "FRAME_PAGES", frame_pages)
        sealed = build(executor, pages, run_lengths)
        assert len(sealed) == (1 if pages else 0)
        check_sealed(sealed, pages)


@settings(max_examples=30, deadline=None)
@given(
    kinds,
    st.integers(0, 2**32),
    frame_sizes,
    st.lists(st.tuples(st.integers(0, 600), st.integers(1, 300)), max_size=10),
)
def test_runs_of_one_buffer_are_gathered_into_frames(
    executor: ThreadPoolExecutor,
    page_kinds: list[PageKind],
    seed: int,
    frame_pages: int,
    wanted: list[tuple[int, int]],
) -> None:
    """``add_runs``: any runs of a buffer (gaps, repeats), cut into frames, gathered natively
    when a frame holds several; after pages queued one by one."""
    pages = make_pages(page_kinds, seed)
    extra = make_pages(["random", "pattern"], seed + 1)
    spans = [(f, min(c, len(pages) - f)) for f, c in wanted if f < len(pages)]
    with pytest.MonkeyPatch.context() as mp:
        if frame_pages:
            mp.setattr(packs, "FRAME_PAGES", frame_pages)
        builder = PackBuilder(executor)
        for page in extra:
            builder.add(HASHER.digest(page), memoryview(page))
        builder.add_runs([HASHER.digest(p) for p in pages], memoryview(b"".join(pages)), spans)
        builder.finish()
        sealed = [build_pack(frames) for frames in builder.take_sealed()]
    check_sealed(sealed, extra + [pages[i] for f, c in spans for i in range(f, f + c)])


@settings(max_examples=10, deadline=None)
@given(kinds, st.integers(0, 2**32), runs)
def test_big_inputs_are_cut_into_several_packs(
    executor: ThreadPoolExecutor,
    page_kinds: list[PageKind],
    seed: int,
    run_lengths: list[int] | None,
) -> None:
    pages = make_pages(page_kinds, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packs, "FRAME_PAGES", 32)
        mp.setattr(packs, "TARGET_PACK_BYTES", 32 * PAGE_SIZE)  # a pack every 2 frames
        sealed = build(executor, pages, run_lengths)
        if len(pages) > 64:
            assert len(sealed) > 1
        check_sealed(sealed, pages)


@pytest.fixture(scope="module")
def one_pack(executor: ThreadPoolExecutor) -> tuple[str, bytes, PackIndex, list[bytes]]:
    """A pack of two frames, the second small (6 pages)."""
    pages = make_pages(["random", "zero", "pattern", "repeat"] * (packs.FRAME_PAGES // 4), 7)
    pages += make_pages(["random", "zero", "pattern", "repeat", "pattern", "random"], 8)
    [(pack_id, blob, index)] = build(executor, pages)
    assert len(index.frames) == 2
    return pack_id, blob, index, pages


def test_flipping_any_bit_of_a_frame_is_detected(
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
) -> None:
    """Flipping bits 0 or 4 of any byte of a frame: read_frame raises CorruptCheckpoint or
    (for a bit the decoder ignores) still returns exactly the right pages — never wrong
    pages, never another exception."""
    pack_id, blob, index, pages = one_pack
    frame = index.frames[1]
    raw = blob[frame.offset : frame.offset + frame.length]
    expected = pages[len(index.frames[0].hashes) :]
    assert read_frame(pack_id, 1, raw, frame.hashes, HASHER) == expected
    refused = 0
    for pos in range(len(raw)):
        for mask in (0x01, 0x10):
            damaged = bytearray(raw)
            damaged[pos] ^= mask
            try:
                got = read_frame(pack_id, 1, bytes(damaged), frame.hashes, HASHER)
            except CorruptCheckpoint as exc:
                assert f"pack {pack_id} frame 1" in exc.message
                refused += 1
            else:
                assert got == expected, (pos, mask)
    assert refused >= 2 * len(raw) - 4


def _frame_with_a_huge_declared_size() -> tuple[bytes, tuple[bytes, ...]]:
    """A frame of 4 pages whose header, after one flipped bit (the Frame_Content_Size flag:
    2 bytes -> 8 bytes), declares between 2**58 and 2**62 bytes of content (more than any
    address space: the allocation fails at once)."""
    for seed in range(1000):
        pages = make_pages(["random"] * 4, seed)
        raw = bytearray(zstandard.ZstdCompressor(level=1).compress(b"".join(pages)))
        raw[4] ^= 0x80
        size = zstandard.frame_content_size(bytes(raw))
        if 2**58 <= size < 2**62:
            return bytes(raw), tuple(HASHER.digest(p) for p in pages)
    raise AssertionError("no such frame")


def test_a_frame_header_declaring_a_huge_size_is_refused() -> None:
    raw, hashes = _frame_with_a_huge_declared_size()
    with pytest.raises(CorruptCheckpoint):
        read_frame("p" * 32, 0, raw, hashes, HASHER)


def test_a_frame_read_against_other_hashes_is_refused(
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
) -> None:
    pack_id, blob, index, _pages = one_pack
    frame = index.frames[0]
    raw = blob[frame.offset : frame.offset + frame.length]
    with pytest.raises(CorruptCheckpoint, match=f"pack {pack_id} frame 0"):
        read_frame(pack_id, 0, raw, frame.hashes[:-1], HASHER)
    with pytest.raises(CorruptCheckpoint, match="page 0: content does not match"):
        read_frame(pack_id, 0, raw, frame.hashes, PageHasher(b"secret", 1))


def test_flipping_any_byte_of_the_trailer_is_detected(
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
) -> None:
    pack_id, blob, _index, _pages = one_pack
    offset, length, checksum = parse_footer(pack_id, blob[-FOOTER.size :])
    raw = blob[offset : offset + length]
    check_trailer(pack_id, raw, checksum)
    for pos in range(length):
        for mask in (0x01, 0xFF):
            damaged = bytearray(raw)
            damaged[pos] ^= mask
            with pytest.raises(CorruptCheckpoint, match="trailer checksum mismatch"):
                check_trailer(pack_id, bytes(damaged), checksum)


def test_a_truncated_pack_is_refused(one_pack: tuple[str, bytes, PackIndex, list[bytes]]) -> None:
    pack_id, blob, _index, _pages = one_pack
    for cut in (0, 1, FOOTER.size - 1, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptCheckpoint, match=f"pack {pack_id}"):
            parse_footer(pack_id, blob[:cut][-FOOTER.size :])


def test_unreadable_trailers_are_refused() -> None:
    with pytest.raises(CorruptCheckpoint, match="unreadable trailer"):
        decode_trailer("p", b"not zstd at all")
    short = zstandard.ZstdCompressor().compress(b"\x05\x00\x00\x00" + bytes(10))
    with pytest.raises(CorruptCheckpoint, match="unreadable trailer"):
        decode_trailer("p", short)


def test_load_pack_index_reads_the_trailer_through_a_blob_store(
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
) -> None:
    pack_id, blob, index, _pages = one_pack
    blobs = MemoryBlobStore()
    blobs.put(pack_key(pack_id), blob)
    assert load_pack_index(blobs, pack_id) == index


def test_any_damage_to_the_footer_is_detected(
    backend: Backend,
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
    request: pytest.FixtureRequest,
) -> None:
    """Every bit of the footer (trailer offset, length, checksum, end marker)."""
    pack_id, blob, _index, _pages = one_pack
    key = pack_key(pack_id)
    backend.blobs.put(key, blob)
    for pos in range(len(blob) - FOOTER.size, len(blob)):
        for bit in range(8):
            backend.corrupt(key, pos, 1 << bit)
            try:
                with pytest.raises(CorruptCheckpoint, match=f"pack {pack_id}"):
                    load_pack_index(backend.blobs, pack_id)
            finally:
                backend.corrupt(key, pos, 1 << bit)


def test_pages_are_verified_with_random_access(
    one_pack: tuple[str, bytes, PackIndex, list[bytes]],
) -> None:
    """Each page of a pack is where its trailer entry says."""
    pack_id, blob, index, pages = one_pack
    rng = random.Random(3)
    entries = list(index.entries())
    for h, f_no, i in rng.sample(entries, 20):
        frame = index.frames[f_no]
        got = read_frame(
            pack_id, f_no, blob[frame.offset : frame.offset + frame.length], frame.hashes,
            HASHER,
        )[i]
        assert HASHER.digest(got) == h
        assert got == pages[sum(len(f.hashes) for f in index.frames[:f_no]) + i]
