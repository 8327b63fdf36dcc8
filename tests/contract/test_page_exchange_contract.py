"""Contract of ``PageExchange``: ``ContentStore`` (over a local blob store) and
``MemoryPageExchange`` answer a migration the same — the store's id and per-uid seeds, a
checkpoint exported for another hash space (every page's reference in it, non-page images as
zstd frames, frames that put every wanted page in its places), the pages it lacks, pages
filled from what it holds, and a checkout of the images as they were."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest
import zstandard

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.ports import PageExchange
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.domain import CheckpointRecord, ProcessFact
from ckptd.errors import PeerError
from ckptd.testing import FakeClock, MemoryPageExchange

UID = 1000
OTHER_SEED = 0x5EED_0F_7A26E7
KEYS = ManifestKeys.generate()


class Harness(Protocol):
    exchange: PageExchange

    def commit(self, record: CheckpointRecord, images: dict[str, bytes]) -> None: ...


class Real:
    def __init__(self, root: Path) -> None:
        self.store = ContentStore(
            LocalBlobStore(root / "objects"), StagingPolicy(None, root / "staging"),
            clock=FakeClock(), is_pages_file=is_pages_image, keys=KEYS)
        self.exchange: PageExchange = self.store

    def commit(self, record: CheckpointRecord, images: dict[str, bytes]) -> None:
        staged = self.store.begin(record.id)
        for name, data in images.items():
            (staged / name).write_bytes(data)
        self.store.commit(record)


class Fake:
    def __init__(self, root: Path) -> None:
        del root
        self.fake = MemoryPageExchange(is_pages=is_pages_image)
        self.exchange: PageExchange = self.fake

    def commit(self, record: CheckpointRecord, images: dict[str, bytes]) -> None:
        self.fake.add(record, images)


def _record(ckpt: str, uid: int = UID) -> CheckpointRecord:
    return CheckpointRecord(id=ckpt, pid=4321, created=1.0, node="n", uid=uid,
                            processes=(ProcessFact(4321, 1, "job", ("job",), uid, uid),))


_RNG = random.Random(7)
PAGES = [_RNG.randbytes(PAGE_SIZE) for _ in range(5)]
MEMORY = PAGES[0] + bytes(PAGE_SIZE) + PAGES[1] + PAGES[2] + PAGES[0] + PAGES[3]
"""Six pages: a zero page and one page twice among them."""
CORE = b"core" * 300
IMAGES = {"pages-1.img": MEMORY, "core-1.img": CORE}
CKPT = "ck-20260101T000000-c0ffee"


@pytest.fixture(params=["real", "fake"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[type[Real] | type[Fake]]:
    kind = Real if request.param == "real" else Fake

    def build(name: str = "a") -> Real | Fake:
        return kind(tmp_path / name)

    yield build  # type: ignore[misc]


@pytest.fixture
def side(make) -> Real | Fake:  # type: ignore[no-untyped-def]
    h = make()
    h.commit(_record(CKPT), IMAGES)
    return h  # type: ignore[no-any-return]


def _pages(data: bytes) -> list[bytes]:
    return [data[i : i + PAGE_SIZE] for i in range(0, len(data), PAGE_SIZE)]


def _own_refs(exchange: PageExchange, uid: int = UID) -> list[bytes]:
    hasher = PageHasher.from_seed(exchange.page_seed(uid))
    return [hasher.page_ref(p) for p in _pages(MEMORY)]


def test_store_id_and_seeds_are_stable_and_its_own(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a"), make("b")
    assert a.exchange.store_id and a.exchange.store_id == a.exchange.store_id
    assert a.exchange.store_id != b.exchange.store_id
    assert a.exchange.page_seed(UID) == a.exchange.page_seed(UID)
    assert a.exchange.page_seed(UID) != a.exchange.page_seed(UID + 1)
    assert a.exchange.page_seed(UID) != b.exchange.page_seed(UID)


def test_an_export_gives_every_page_in_the_targets_hash_space(side) -> None:  # type: ignore[no-untyped-def]
    theirs = PageHasher.from_seed(OTHER_SEED)
    with side.exchange.export(CKPT, OTHER_SEED) as export:
        images = {i.name: i for i in export.images}
    assert set(images) == set(IMAGES)
    pages = images["pages-1.img"]
    assert pages.size == len(MEMORY)
    assert pages.refs == b"".join(theirs.page_ref(p) for p in _pages(MEMORY))
    assert pages.pages == 5  # not the zero page
    core = images["core-1.img"]
    assert core.refs is None and core.size == len(CORE)
    assert zstandard.ZstdDecompressor().decompress(core.data, max_output_size=len(CORE)) == CORE


def test_frames_put_every_wanted_page_in_its_places(side) -> None:  # type: ignore[no-untyped-def]
    wanted = [0, 2, 5]
    got: dict[int, bytes] = {}
    with side.exchange.export(CKPT, OTHER_SEED) as export:
        for frame in export.frames({"pages-1.img": wanted}):
            data = (frame.data if frame.raw else zstandard.ZstdDecompressor().decompress(
                frame.data, max_output_size=frame.pages * PAGE_SIZE))
            assert len(data) == frame.pages * PAGE_SIZE
            for image, at, first, count in frame.runs:
                assert image == "pages-1.img"
                for k in range(count):
                    got[at + k] = bytes(data[(first + k) * PAGE_SIZE : (first + k + 1) * PAGE_SIZE])
    memory = _pages(MEMORY)
    assert set(wanted) <= set(got)
    assert all(got[i] == memory[i] for i in got)


def test_frames_refuse_a_page_the_image_lacks(side) -> None:  # type: ignore[no-untyped-def]
    with side.exchange.export(CKPT, OTHER_SEED) as export, pytest.raises(PeerError):
        list(export.frames({"pages-1.img": [6]}))


def test_lacks_names_the_pages_it_does_not_hold(side) -> None:  # type: ignore[no-untyped-def]
    hasher = PageHasher.from_seed(side.exchange.page_seed(UID))
    new = hasher.page_ref(PAGES[4])
    refs = [*_own_refs(side.exchange), new, ZERO_REF]
    assert side.exchange.lacks(UID, refs) == [6]
    other = PageHasher.from_seed(side.exchange.page_seed(UID + 1))
    assert side.exchange.lacks(UID + 1, [other.page_ref(PAGES[0])]) == [0]


def test_fill_pages_writes_what_it_holds_but_the_skipped(side, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    refs = _own_refs(side.exchange)
    out = tmp_path / "pages-1.img"
    side.exchange.fill_pages(UID, out, refs, frozenset({3}))
    data = out.read_bytes()
    memory = _pages(MEMORY)
    assert len(data) == len(MEMORY)
    assert [p for i, p in enumerate(_pages(data)) if i != 3] == [
        p for i, p in enumerate(memory) if i != 3]
    assert _pages(data)[3] == bytes(PAGE_SIZE)
    assert len(refs[0]) == HASH_SIZE


def test_a_checkout_is_the_images_as_they_were(side) -> None:  # type: ignore[no-untyped-def]
    with side.exchange.checkout(CKPT) as images:
        assert {p.name: p.read_bytes() for p in images.iterdir()} == IMAGES
        kept = images
    deadline = time.monotonic() + 10  # removed on exit, maybe off the caller's path
    while kept.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not kept.exists()
