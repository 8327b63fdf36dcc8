"""The per-page data path: the C extension (ckptd._pages) against the pure-Python one, which is
the fallback and the reference. Identical hashes (and byte-identical to xxhash), zero pages,
dedup plans and verification (the first corrupted page found), whatever the threads; frames
that do not compress are stored as they are and read back by the same rule.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import random
from collections.abc import Iterator
from types import ModuleType

import lz4.frame
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store import pagepath
from ckptd.core.store.packs import read_frame_data
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_PAGE, ZERO_REF, PageHasher
from ckptd.core.store.pagepath import (
    DEFAULT_COMPRESSION,
    LZ4_MAGIC,
    ZSTD_MAGIC,
    CodecName,
    Compression,
)
from ckptd.errors import CorruptCheckpoint

from .support import PAGE_KINDS, make_pages

native: ModuleType | None
try:
    from ckptd import _pages as native
except ImportError:
    native = None

needs_native = pytest.mark.skipif(native is None, reason="ckptd._pages is not built")

kinds = st.lists(st.sampled_from(PAGE_KINDS), max_size=300)
seeds = st.integers(0, 2**64 - 1)
threads = st.sampled_from([0, 1, 2, 3, 7, 64])


def reference(pages: list[bytes], seed: int, zero_ref: bool) -> bytes:
    return b"".join(
        ZERO_REF if zero_ref and p == ZERO_PAGE else xxhash.xxh3_128_digest(p, seed=seed)
        for p in pages
    )


@settings(max_examples=60, deadline=None)
@given(kinds, st.integers(0, 2**32), seeds, st.booleans(), threads)
def test_hashes_and_zero_pages_are_identical(
    page_kinds: list[str], content: int, seed: int, zero_ref: bool, n_threads: int
) -> None:
    pages = make_pages(page_kinds, content)
    buffer = b"".join(pages)
    want = reference(pages, seed, zero_ref)
    assert pagepath.py_hash_pages(buffer, seed, zero_ref=zero_ref) == want
    if native is not None:
        assert native.hash_pages(buffer, seed, zero_ref=zero_ref, threads=n_threads) == want
        assert native.hash_pages(memoryview(bytearray(buffer)), seed, zero_ref=zero_ref) == want


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(PAGE_KINDS), min_size=1, max_size=300),
    st.integers(0, 2**32),
    seeds,
    st.data(),
    threads,
)
def test_verification_finds_the_first_corrupted_page(
    page_kinds: list[str], content: int, seed: int, data: st.DataObject, n_threads: int
) -> None:
    pages = make_pages(page_kinds, content)
    buffer = bytearray(b"".join(pages))
    hashes = reference(pages, seed, zero_ref=False)
    assert pagepath.py_verify_pages(buffer, hashes, seed) == -1
    if native is not None:
        assert native.verify_pages(buffer, hashes, seed, threads=n_threads) == -1
    damaged = data.draw(st.sets(st.integers(0, len(pages) - 1), min_size=1, max_size=4))
    for page in damaged:
        bit = data.draw(st.integers(0, PAGE_SIZE * 8 - 1))
        buffer[page * PAGE_SIZE + bit // 8] ^= 1 << (bit % 8)
    assert pagepath.py_verify_pages(buffer, hashes, seed) == min(damaged)
    if native is not None:
        assert native.verify_pages(buffer, hashes, seed, threads=n_threads) == min(damaged)


class OddContainer:
    """A ``known`` without a C-level lookup (an index with condemned packs)."""

    def __init__(self, items: set[bytes]) -> None:
        self.items = items

    def __contains__(self, item: object) -> bool:
        return item in self.items


@settings(max_examples=60, deadline=None)
@given(kinds, st.integers(0, 2**32), st.data(), st.sampled_from(["set", "dict", "object"]))
def test_dedup_plans_are_identical(
    page_kinds: list[str], content: int, data: st.DataObject, known_kind: str
) -> None:
    pages = make_pages(page_kinds, content)
    refs = reference(pages, 9, zero_ref=True)
    distinct = sorted({refs[i : i + HASH_SIZE] for i in range(0, len(refs), HASH_SIZE)})
    known_set = set(data.draw(st.lists(st.sampled_from(distinct))) if distinct else [])
    fresh0 = set(data.draw(st.lists(st.sampled_from(distinct))) if distinct else [])
    known = {
        "set": known_set,
        "dict": dict.fromkeys(known_set),
        "object": OddContainer(known_set),
    }[known_kind]
    fresh_py = set(fresh0)
    listed, runs = pagepath.py_plan_new(refs, known, fresh_py)
    assert b"".join(listed) == refs
    # what the runs plan is exactly the first occurrence of every page not zero nor known
    planned = [i for first, count in runs for i in range(first, first + count)]
    seen = set(fresh0)
    expected = []
    for i, ref in enumerate(listed):
        if ref != ZERO_REF and ref not in known_set and ref not in seen:
            seen.add(ref)
            expected.append(i)
    assert planned == expected
    assert all(count > 0 for _, count in runs)
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))  # maximal
    assert fresh_py == seen
    if native is not None:
        fresh_c = set(fresh0)
        assert native.plan_new(refs, known, fresh_c) == (listed, runs)
        assert fresh_c == fresh_py


@needs_native
@settings(max_examples=40, deadline=None)
@given(kinds, st.integers(0, 2**32), st.integers(1, 7), st.data())
def test_plans_made_in_chunks_are_the_same(
    page_kinds: list[str], content: int, chunk: int, data: st.DataObject
) -> None:
    """The steps that hold the GIL run in chunks (``GIL_CHUNK`` pages per native call): the
    same dedup plan, and restore runs that cover the same pages in the same places."""
    pages = make_pages(page_kinds, content)
    refs = reference(pages, 3, zero_ref=True)
    listed = [refs[i : i + HASH_SIZE] for i in range(0, len(refs), HASH_SIZE)]
    known = set(data.draw(st.lists(st.sampled_from(listed))) if listed else [])
    codes = [None if r == ZERO_REF or r in known else (7 << 32) + i for i, r in enumerate(listed)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pagepath, "GIL_CHUNK", chunk)
        fresh_a: set[bytes] = set()
        assert pagepath.plan_new(refs, known, fresh_a) == pagepath.py_plan_new(refs, known, set())
        runs, missing = pagepath.code_runs(codes, listed)
    want_runs, want_missing = pagepath.py_code_runs(codes, listed)
    assert missing == want_missing
    assert {(a + k, c + k) for a, c, n in runs for k in range(n)} == {
        (a + k, c + k) for a, c, n in want_runs for k in range(n)
    }


COMPRESSIONS = [Compression("zstd", 1), Compression("zstd", -3), Compression("lz4", 0),
                Compression("lz4", -4)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(PAGE_KINDS), min_size=1, max_size=200), st.integers(0, 2**32),
       st.sampled_from(COMPRESSIONS))
def test_frames_compress_or_are_stored_as_they_are(
    page_kinds: list[str], content: int, compression: Compression
) -> None:
    """Either path's frame, of either codec, is strictly shorter than its pages (a frame of
    that codec) or exactly as long (raw), and reads back, verified, to the same pages, by
    either path's decompression."""
    pages = make_pages(page_kinds, content)
    data = b"".join(pages)
    hasher = PageHasher(b"secret", 3)
    hashes = tuple(hasher.digest(p) for p in pages)
    compressors = [pagepath.py_compress_frame]
    if native is not None:
        compressors.append(native_compress)
    magic = LZ4_MAGIC if compression.codec == "lz4" else ZSTD_MAGIC
    for compress in compressors:
        frame = bytes(compress(data, compression))
        assert len(frame) <= len(data)
        if len(frame) == len(data):
            assert frame == data
        else:
            assert frame.startswith(magic)
            assert pagepath.py_decompress_frame(frame, len(data)) == data
        assert read_frame_data("p", 0, frame, hashes, hasher) == data


def native_compress(data: bytes, compression: Compression = DEFAULT_COMPRESSION) -> bytes:
    assert native is not None
    codec = native.CODEC_LZ4 if compression.codec == "lz4" else native.CODEC_ZSTD
    frame = native.compress_frame(data, compression.level, codec)
    return data if frame is None else frame


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_damaged_frame_of_either_codec_is_refused_by_both_paths(
    codec: CodecName, impl: ModuleType
) -> None:
    """Cut short, a flipped byte, a header declaring another size, trailing bytes, another
    format: ValueError from either path, never other pages."""
    rng = random.Random(9)
    text = b"".join(f"{{\"n\":{rng.randrange(10**6)}}}\n".encode() for _ in range(40_000))
    data = text[: 64 * PAGE_SIZE]
    frame = bytes(pagepath.compress_frame(data, Compression(codec, 1)))
    assert len(frame) < len(data)
    assert impl.decompress_frame(frame, len(data)) == data
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0xFF
    for bad, size in [(frame[: len(frame) // 2], len(data)), (frame, len(data) - PAGE_SIZE),
                      (frame, len(data) + PAGE_SIZE), (frame + b"\0" * 8, len(data)),
                      (b"CKPACK01" + frame, len(data)), (b"", len(data))]:
        with pytest.raises(ValueError):
            impl.decompress_frame(bad, size)
    with contextlib.suppress(ValueError):  # refused, or other bytes (the hashes catch them)
        assert impl.decompress_frame(bytes(flipped), len(data)) != data


def test_compression_settings_are_checked() -> None:
    assert str(Compression()) == "zstd level 1"
    with pytest.raises(ValueError, match="one of zstd, lz4"):
        Compression("gzip", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"zstd level 20 must be in \[-50, 19\]"):
        Compression("zstd", 20)
    with pytest.raises(ValueError, match="lz4 level"):
        Compression("lz4", -51)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=8), st.booleans())
def test_packs_are_joined_and_named_alike(parts: list[bytes], views: bool) -> None:
    given_parts: list[bytes | memoryview] = [memoryview(p) if views else p for p in parts]
    want = (b"".join(parts), xxhash.xxh3_128_digest(b"".join(parts)))
    assert pagepath.py_concat_digest(given_parts) == want
    if native is not None:
        assert native.concat_digest(given_parts) == want


@needs_native
def test_incompressible_frames_are_raw_and_compressible_ones_are_not() -> None:
    assert native is not None
    rng = random.Random(5)
    noise = rng.randbytes(1024 * PAGE_SIZE)
    assert native.compress_frame(noise, 1) is None  # stored as it is
    assert native.compress_frame(noise[: 3 * PAGE_SIZE], 1) is None
    text = b"".join(
        f'{{"id":{rng.randrange(10**7)},"ok":true}}\n'.encode() for _ in range(200_000)
    )[: 1024 * PAGE_SIZE]
    frame = native_compress(text)
    assert len(frame) < len(text) // 2
    assert zstandard.ZstdDecompressor().decompress(frame) == text
    lz4_frame = native_compress(text, Compression("lz4", 0))
    assert len(lz4_frame) < len(text) // 2
    assert lz4.frame.decompress(lz4_frame) == text  # a standard LZ4 frame
    assert native.compress_frame(noise, 0, native.CODEC_LZ4) is None
    # a frame of mixed pages (random ones every other page) still compresses
    mixed = b"".join(
        (noise if i % 2 else text)[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(1024)
    )
    assert len(native_compress(mixed)) < len(mixed) * 3 // 4


def test_a_legacy_zstd_frame_exactly_as_long_as_its_pages_still_reads() -> None:
    """Packs written before raw frames existed are read unchanged, even a zstd frame whose
    length happens to equal its pages' (hand-made here: a raw block and an RLE block)."""
    page = random.Random(1).randbytes(PAGE_SIZE - 14) + bytes(14)
    header = ZSTD_MAGIC + bytes([0x60]) + (PAGE_SIZE - 256).to_bytes(2, "little")
    raw_block = ((PAGE_SIZE - 14) << 3).to_bytes(3, "little") + page[: PAGE_SIZE - 14]
    rle_block = ((14 << 3) | (1 << 1) | 1).to_bytes(3, "little") + b"\x00"
    frame = header + raw_block + rle_block
    assert len(frame) == PAGE_SIZE
    assert zstandard.ZstdDecompressor().decompress(frame) == page
    hasher = PageHasher(b"secret", 0)
    assert read_frame_data("p", 0, frame, (hasher.digest(page),), hasher) == page
    with pytest.raises(CorruptCheckpoint, match="frame 0"):
        read_frame_data("p", 0, frame, (hasher.digest(page[::-1]),), hasher)


@pytest.mark.parametrize("starts_like_zstd", [False, True])
def test_any_damage_to_a_raw_frame_is_detected(starts_like_zstd: bool) -> None:
    rng = random.Random(2)
    pages = [rng.randbytes(PAGE_SIZE) for _ in range(5)]
    if starts_like_zstd:  # memory can hold anything, the zstd magic number too
        pages[0] = ZSTD_MAGIC + pages[0][4:]
    data = b"".join(pages)
    hasher = PageHasher(b"secret", 0)
    hashes = tuple(hasher.digest(p) for p in pages)
    assert read_frame_data("p", 2, data, hashes, hasher) == data
    for pos in range(0, len(data), 97):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        with pytest.raises(CorruptCheckpoint, match="pack p frame 2"):
            read_frame_data("p", 2, bytes(damaged), hashes, hasher)
    with pytest.raises(CorruptCheckpoint, match="page 1: content does not match"):
        read_frame_data("p", 2, data, (hashes[0], hashes[0], *hashes[2:]), hasher)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 39), st.integers(0, 8)), max_size=10),
)
def test_runs_are_written_where_they_belong(pages: int, wanted: list[tuple[int, int, int]]) -> None:
    rng = random.Random(pages)
    buffer = rng.randbytes(pages * PAGE_SIZE)
    runs = [(d, s, min(c, pages - s)) for d, s, c in wanted if s < pages]
    expected = bytearray(70 * PAGE_SIZE)
    for d, s, c in runs:
        expected[d * PAGE_SIZE : (d + c) * PAGE_SIZE] = buffer[s * PAGE_SIZE : (s + c) * PAGE_SIZE]
    writers = [pagepath.py_write_runs] + ([native.write_runs] if native is not None else [])
    for write in writers:
        fd = os.memfd_create("runs")
        try:
            os.ftruncate(fd, 70 * PAGE_SIZE)
            write(fd, memoryview(buffer), runs)
            assert os.pread(fd, 70 * PAGE_SIZE, 0) == expected
        finally:
            os.close(fd)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(0, 8)), max_size=10))
def test_runs_are_gathered_in_order(pages: int, wanted: list[tuple[int, int]]) -> None:
    buffer = random.Random(pages).randbytes(pages * PAGE_SIZE)
    runs = [(f, min(c, pages - f)) for f, c in wanted if f < pages]
    expected = b"".join(buffer[f * PAGE_SIZE : (f + c) * PAGE_SIZE] for f, c in runs)
    assert pagepath.py_gather_pages(buffer, runs) == expected
    if native is not None:
        assert native.gather_pages(memoryview(buffer), runs) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 6)), max_size=40), st.integers(0, 2**30))
def test_restore_plans_are_identical(steps: list[int | None], base: int) -> None:
    """Codes as the index gives them: None (a zero page, or a page in no pack), else
    consecutive or not; a run is a stretch of codes each one more than the last."""
    codes: list[int | None] = []
    refs: list[bytes] = []
    code = base << 32
    for k, step in enumerate(steps):
        if step is None:
            codes.append(None)
            refs.append(ZERO_REF if k % 3 else bytes([k + 1]) * HASH_SIZE)
        else:
            code += step  # 1: the next page of the frame
            codes.append(code)
            refs.append(bytes([k + 1]) * HASH_SIZE)
    runs, missing = pagepath.py_code_runs(codes, refs)
    assert missing == [i for i, c in enumerate(codes) if c is None and refs[i] != ZERO_REF]
    covered = [(at + k, first + k) for at, first, n in runs for k in range(n)]
    assert covered == [(i, c) for i, c in enumerate(codes) if c is not None]
    assert all(
        not (a + n == b and f + n == g) for (a, f, n), (b, g, _) in itertools.pairwise(runs)
    )  # maximal
    if native is not None:
        assert native.code_runs(codes, refs) == (runs, missing)


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    if request.param == "native":
        if native is None:
            pytest.skip("ckptd._pages is not built")
        yield type("native", (), {
            name: staticmethod(getattr(native, name)) for name in dir(native)
            if not name.startswith("_")
        } | {"compress_frame": staticmethod(native_compress)})  # type: ignore[misc]
        return
    yield type("py", (), {
        "decompress_frame": staticmethod(pagepath.py_decompress_frame),
        "hash_pages": staticmethod(pagepath.py_hash_pages),
        "verify_pages": staticmethod(pagepath.py_verify_pages),
        "plan_new": staticmethod(pagepath.py_plan_new),
        "compress_frame": staticmethod(pagepath.py_compress_frame),
        "write_runs": staticmethod(pagepath.py_write_runs),
        "gather_pages": staticmethod(pagepath.py_gather_pages),
        "code_runs": staticmethod(pagepath.py_code_runs),
    })  # type: ignore[misc]


def test_bad_arguments_are_refused(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="whole number"):
        impl.hash_pages(bytes(PAGE_SIZE + 1), 0)
    with pytest.raises(ValueError, match="whole number"):
        impl.verify_pages(bytes(PAGE_SIZE - 1), b"", 0)
    with pytest.raises(ValueError):
        impl.verify_pages(bytes(2 * PAGE_SIZE), bytes(HASH_SIZE), 0)
    with pytest.raises(ValueError, match="whole number"):
        impl.plan_new(bytes(HASH_SIZE + 3), set(), set())
    with pytest.raises(ValueError):
        impl.compress_frame(b"", Compression())
    with pytest.raises(ValueError, match="whole number"):
        impl.compress_frame(bytes(100), Compression())
    fd = os.memfd_create("bad")
    try:
        for run in [(0, 1, 2), (0, -1, 1), (-1, 0, 1), (0, 3, 0)]:
            with pytest.raises(ValueError, match="outside"):
                impl.write_runs(fd, bytes(2 * PAGE_SIZE), [run])
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        impl.write_runs(fd, bytes(PAGE_SIZE), [(0, 0, 1)])  # closed
    for run in [(1, 2), (-1, 1), (0, -1), (3, 0)]:
        with pytest.raises(ValueError, match="outside"):
            impl.gather_pages(bytes(2 * PAGE_SIZE), [run])
    with pytest.raises(ValueError, match="as many"):
        impl.code_runs([None], [])
    assert impl.code_runs([], []) == ([], [])
    assert impl.hash_pages(b"", 5) == b""
    assert impl.verify_pages(b"", b"", 5) == -1
    assert impl.plan_new(b"", set(), set()) == ([], [])


@needs_native
def test_native_refuses_what_python_cannot_express() -> None:
    assert native is not None
    for seed in (-1, 2**64):
        with pytest.raises(OverflowError):
            native.hash_pages(bytes(PAGE_SIZE), seed)
    with pytest.raises(TypeError):
        native.hash_pages(bytes(PAGE_SIZE), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native.plan_new(b"", set(), frozenset())  # type: ignore[arg-type]
    with pytest.raises(BufferError):
        native.hash_pages(memoryview(bytes(2 * PAGE_SIZE))[::2], 0)
    assert native.cpu_count() >= 1


@needs_native
def test_an_mmap_cannot_be_closed_under_a_call() -> None:
    """The buffer is held for the whole call (released after): closing works afterwards."""
    assert native is not None
    mm = mmap.mmap(-1, 64 * PAGE_SIZE)
    view = memoryview(mm)
    native.hash_pages(view, 1)
    view.release()
    mm.close()


@needs_native
@pytest.mark.slow
def test_buffers_over_4_gib() -> None:
    """5 GiB of (shared, never allocated) zero pages with two written pages past 4 GiB: page
    indexes, hash offsets and the result's size do not overflow 32 bits."""
    assert native is not None
    size = 5 << 30
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        pytest.skip(f"cannot map 5 GiB here: {exc}")
    try:
        pages = size // PAGE_SIZE
        marked = [(4 << 30) // PAGE_SIZE + 3, pages - 1]
        for p in marked:
            mm[p * PAGE_SIZE : p * PAGE_SIZE + 4] = b"page"
        refs = native.hash_pages(mm, 11, zero_ref=True)
        assert len(refs) == pages * HASH_SIZE
        page = b"page" + bytes(PAGE_SIZE - 4)
        want = xxhash.xxh3_128_digest(page, seed=11)
        for p in marked:
            assert refs[p * HASH_SIZE : (p + 1) * HASH_SIZE] == want
        nonzero = [i for i in range(0, len(refs), HASH_SIZE) if refs[i : i + HASH_SIZE] != ZERO_REF]
        assert nonzero == [p * HASH_SIZE for p in marked]
        hashes = bytearray(native.hash_pages(mm, 11))
        assert native.verify_pages(mm, hashes, 11) == -1
        hashes[-1] ^= 1
        assert native.verify_pages(mm, hashes, 11) == pages - 1
    finally:
        mm.close()


def test_the_fallback_says_once_that_it_is_slow(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pagepath, "_native", None)
    pagepath.warn_if_slow.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=pagepath.__name__):
            pagepath.warn_if_slow()
            pagepath.warn_if_slow()
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "not built" in caplog.records[0].message
    finally:
        pagepath.warn_if_slow.cache_clear()
