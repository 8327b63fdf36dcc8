"""Issue #13: a dump's page references are held packed (16 bytes a page), not as an object
per page; the page lists and the footprint it stores are the same as before."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptd.core.store import pagelist, pagepath
from ckptd.core.store.index import SLOT_SHIFT, PageIndex
from ckptd.core.store.ingest import IngestResult, ingest
from ckptd.core.store.objects import put_blob
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.core.store.streaming import StreamedPages
from ckptd.errors import CorruptCheckpoint
from ckptd.testing import MemoryBlobStore

HASHER = PageHasher(b"k", 0)
REF = bytes(range(1, 17))
TAIL0 = bytes(range(1, 9)) + bytes(8)  # ends in zeros: ZERO_REF found unaligned next to one


@pytest.mark.parametrize(
    "refs",
    [
        [],
        [ZERO_REF],
        [ZERO_REF] * 3000,
        [REF] * 5,
        [ZERO_REF, REF, REF, ZERO_REF, ZERO_REF, REF],
        [TAIL0, ZERO_REF, TAIL0, bytes(8) + REF[:8], ZERO_REF, ZERO_REF],
        [REF, *[ZERO_REF] * 2500, TAIL0, *[ZERO_REF] * 1024],
    ],
)
def test_full_list_of_packed_refs_is_the_lists(refs: list[bytes]) -> None:
    packed = b"".join(refs)
    assert pagelist.encode_full(packed) == pagelist.encode_full(refs)
    assert pagelist.encode_full(bytearray(packed)) == pagelist.encode_full(refs)
    assert list(pagelist.Refs(packed)) == refs
    assert pagelist.decode(pagelist.encode_full(packed)) == refs


def test_refs_is_a_sequence() -> None:
    refs = pagelist.Refs(ZERO_REF + REF + TAIL0)
    assert len(refs) == 3 and refs[-1] == TAIL0 and refs[1:] == [REF, TAIL0]
    with pytest.raises(IndexError):
        refs[3]
    with pytest.raises(ValueError):
        pagelist.Refs(bytes(HASH_SIZE + 1))


def _mixed(seed: int, known: list[bytes], n: int = 700) -> list[bytes]:
    """Zero, known (already stored), new and repeated (new or known) pages, shuffled runs."""
    rng = random.Random(seed)
    pages: list[bytes] = []
    while len(pages) < n:
        kind = rng.choice(("zero", "known", "new", "repeat"))
        run = rng.randrange(1, 9)
        for _ in range(run):
            if kind == "zero":
                pages.append(bytes(PAGE_SIZE))
            elif kind == "known":
                pages.append(rng.choice(known))
            elif kind == "repeat" and pages:
                pages.append(rng.choice(pages))
            else:
                pages.append(rng.randbytes(PAGE_SIZE))
    return pages[:n]


def test_plan_runs_is_plan_new_without_the_list(
    data_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    known_pages = [random.Random(1).randbytes(PAGE_SIZE) for _ in range(20)]
    known = {HASHER.digest(p) for p in known_pages}
    digests = pagepath.hash_pages(b"".join(_mixed(2, known_pages)), HASHER.seed, zero_ref=True)
    for chunk in (3, 64, pagepath.GIL_CHUNK):  # runs across chunks are joined
        monkeypatch.setattr(pagepath, "GIL_CHUNK", chunk)
        fresh_a: set[bytes] = set()
        fresh_b: set[bytes] = set()
        listed, runs = pagepath.plan_new(digests, known, fresh_a)
        new, runs_b = pagepath.plan_runs(digests, known, fresh_b)
        assert runs_b == runs and fresh_b == fresh_a
        assert new == [listed[i] for first, count in runs for i in range(first, first + count)]
        assert all(any(h is f for f in fresh_b) for h in new[:50])  # the same objects


def test_slot_counts_count_distinct_pages() -> None:
    rng = random.Random(3)
    refs = [rng.randbytes(HASH_SIZE) for _ in range(300)]
    pages = {r: (i % 7) << SLOT_SHIFT | i for i, r in enumerate(refs[:200])}  # 100 not indexed
    buffers = [b"".join(rng.choice(refs) for _ in range(400)) + ZERO_REF for _ in range(3)]
    want = Counter(
        pages[r] >> SLOT_SHIFT
        for r in {b[i : i + HASH_SIZE] for b in buffers for i in range(0, len(b), HASH_SIZE)}
        if r in pages
    )
    assert pagepath.py_slot_counts(buffers, pages) == want
    if pagepath.is_native():
        assert pagepath.slot_counts(buffers, pages) == want
        assert pagepath.slot_counts([], pages) == {}
        with pytest.raises(ValueError):
            pagepath.slot_counts([bytes(HASH_SIZE + 1)], pages)


@pytest.mark.parametrize("streamed", [False, True], ids=["staged", "streamed"])
def test_page_lists_and_footprint_as_before(data_path: str, tmp_path: Path, streamed: bool) -> None:
    """A mixed image (zero, known, new, repeated pages): its stored page list is the one the
    list of references encoded to, and the pages per frame (so packs and footprint) are those
    of the set of its references."""
    blobs, index = MemoryBlobStore(), PageIndex()
    known_pages = [random.Random(4).randbytes(PAGE_SIZE) for _ in range(40)]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "pages-1.img").write_bytes(b"".join(known_pages))
    pages = _mixed(5, known_pages)
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:

        def run(images: Path, sink: StreamedPages | None = None) -> IngestResult:
            return ingest(images, blobs=blobs, index=index, hasher=HASHER,
                          is_pages_file=lambda n: n.startswith("pages-"),
                          base_for=lambda _n: None, executor=pool, writer=writer,
                          streamed=sink)

        run(first)
        if streamed:
            sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                                 writer=writer, pack_bytes=64 * PAGE_SIZE)
            sink.begin_image("pages-2.img")
            for at in range(0, len(pages), 9):  # chunks of 9 pages, packs of 64
                chunk = b"".join(pages[at : at + 9])
                sink.pages("pages-2.img", at * PAGE_SIZE, memoryview(chunk))
            sink.end_image("pages-2.img", len(pages) * PAGE_SIZE)
            sink.finish()
            result = run(second, sink)
        else:
            (second / "pages-2.img").write_bytes(b"".join(pages))
            result = run(second)
    refs = [ZERO_REF if p == bytes(PAGE_SIZE) else HASHER.digest(p) for p in pages]
    (entry,) = result.files
    assert entry.pages == len(refs)
    assert entry.pagelist == put_blob(blobs, HASHER, pagelist.encode_full(refs))[0]
    assert result.pages == [b"".join(refs)]
    codes, frames = index.locate(set(refs) - {ZERO_REF})  # as the commit did before #13
    assert None not in codes
    before = Counter(code >> SLOT_SHIFT for code in codes if code is not None)
    per_slot, frames_now = index.slot_counts(result.pages)
    assert per_slot == before and frames_now == frames


def _refs_like_a_child(seed: int, base: list[bytes], n: int) -> list[bytes]:
    """A child's references against ``base``: copied runs (moved too), zero runs, new ones."""
    rng = random.Random(seed)
    refs: list[bytes] = []
    while len(refs) < n:
        kind = rng.choice(("same", "moved", "zero", "new"))
        run = rng.randrange(1, 40)
        if kind == "same" and len(refs) < len(base):
            refs += base[len(refs) : len(refs) + run]
        elif kind == "moved" and base:
            at = rng.randrange(len(base))
            refs += base[at : at + run]
        elif kind == "zero":
            refs += [ZERO_REF] * run
        else:
            refs += [rng.randbytes(HASH_SIZE) for _ in range(run)]
    return refs[:n]


@pytest.mark.parametrize("seed", range(6))
def test_packed_delta_is_the_lists(data_path: str, seed: int) -> None:
    rng = random.Random(seed)
    pool = [rng.randbytes(HASH_SIZE) for _ in range(50)]
    base = [rng.choice([*pool, ZERO_REF]) for _ in range(rng.randrange(0, 600))]  # repeats
    refs = _refs_like_a_child(seed, base, rng.randrange(0, 700))
    want = pagelist.encode_delta(refs, base, REF)
    assert pagepath.encode_delta(b"".join(refs), b"".join(base), REF) == want
    assert pagepath.encode_delta(bytearray(b"".join(refs)), b"".join(base), REF) == want
    assert pagelist.decode(want, base) == refs


def test_packed_delta_edge_cases(data_path: str) -> None:
    for refs, base in (([], []), ([REF], []), ([], [REF]), ([ZERO_REF] * 3, [ZERO_REF]),
                       ([REF, ZERO_REF, REF], [REF, ZERO_REF, REF]), ([TAIL0] * 4, [TAIL0])):
        want = pagelist.encode_delta(refs, base, REF)
        assert pagepath.encode_delta(b"".join(refs), b"".join(base), REF) == want
    if pagepath.is_native():
        with pytest.raises(ValueError):
            pagepath.encode_delta(bytes(17), b"", REF)


@pytest.mark.parametrize("seed", range(4))
def test_packed_base_is_the_decoded_list(seed: int) -> None:
    rng = random.Random(seed)
    base = _refs_like_a_child(seed, [], rng.randrange(0, 500))
    data = pagelist.encode_full(base)
    assert pagelist.decode_full_packed(data) == b"".join(pagelist.decode(data))
    assert pagelist.decode_full_packed(data, pages=len(base)) == b"".join(base)
    for cut in {0, 3, len(data) // 2, len(data) - 1}:  # damaged: rejected as decode rejects it
        bad = data[:cut] + bytes([data[cut] ^ 0xFF]) + data[cut + 1 :] if data else data
        try:
            want: bytes | type[Exception] = b"".join(pagelist.decode(bad))
        except CorruptCheckpoint:
            want = CorruptCheckpoint
        if want is CorruptCheckpoint:
            with pytest.raises(CorruptCheckpoint):
                pagelist.decode_full_packed(bad)
        else:
            assert pagelist.decode_full_packed(bad) == want
    with pytest.raises(CorruptCheckpoint):
        pagelist.decode_full_packed(data, pages=len(base) + 1)
    with pytest.raises(CorruptCheckpoint):
        pagelist.decode_full_packed(pagelist.encode_delta(base, base, REF))
