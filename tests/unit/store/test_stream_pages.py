"""``ImageSource.pages`` of a real store (``CheckpointImages`` over ``RandomPages``), what a lazy
restore serves pages from: any run of pages, in any order, is byte for byte what
``DirectoryImages.pages`` reads from the checkout of the same checkpoint (runs at the start,
across frames, of zero pages only, at the end, of none), past the end an IndexError from
both; a damaged frame raises before a byte of it is returned, the other frames still read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ckptd.core.store.cas import ContentStore
from ckptd.core.store.index import load_pack_index, pack_key
from ckptd.core.store.restream import CheckpointImages, DirectoryImages
from ckptd.errors import CorruptCheckpoint

from .support import PAGE, Backend, commit, images, make_pages

pytestmark = pytest.mark.usefixtures("data_path")  # each test on the C and the Python path

FRAME_PAGES = 1024  # a frame holds 4 MiB of pages


def _kinds() -> list[str]:
    """About three frames of pages, with runs of zero pages (stored as none: gaps between
    the frames' segments), pages repeated from earlier, and zero pages at the very end."""
    return (["random"] * 1000 + ["zero"] * 100 + ["random"] * 500 + ["repeat"] * 200
            + ["pattern"] * 50 + ["zero"] * 30 + ["random"] * 800 + ["zero"] * 20)


N = len(_kinds())
RUNS = [
    (0, 1), (0, 7), (0, 0),  # the start
    # across frames: a frame holds 1024 pages *stored* (zero pages take none, repeats one),
    # so the parent's frame 1 begins at its page 1124 (1000 + 100 zero + 24); the child's
    # image goes back and forth between its own pack and its parent's
    (1120, 8), (1090, 40), (990, 140), (FRAME_PAGES - 3, 6), (FRAME_PAGES * 2 - 1, 2),
    (1000, 100), (1750, 30), (1779, 2),  # zero pages only; the edge of a zero run
    (1600, 200),  # repeats: pages stored once, in earlier frames
    (0, N),  # the whole image
    (N - 1, 1), (N - 20, 20), (N - 21, 21), (N - 900, 900), (N, 0),  # the end
]
BEYOND = [(N, 1), (N - 1, 2), (N + 5, 0), (-1, 1), (0, -1), (0, N + 1)]


def _checkpoint(backend: Backend, seed: int) -> tuple[ContentStore, str, str]:
    """A parent and a child sharing most of its pages (the child's image reads frames of the
    parent's pack between its own); the child's id, and the parent's."""
    store = backend.store()
    pages = make_pages(_kinds(), seed)
    parent = commit(store, backend.clock, images(pages, seed))
    rng = random.Random(seed)
    changed = list(pages)
    for i in rng.sample(range(N), 300):
        changed[i] = rng.randbytes(PAGE)
    child = commit(store, backend.clock, images(changed, seed), parent_id=parent.id)
    return store, child.id, parent.id


@pytest.mark.parametrize("which", ["child", "parent"])
def test_pages_read_at_any_run_are_the_checkout_s(backend: Backend, tmp_path: Path,
                                                  which: str) -> None:
    store, child, parent = _checkpoint(backend, 11)
    checkpoint_id = child if which == "child" else parent
    with store.checkout(checkpoint_id) as directory, \
            store.checkout_streamed(checkpoint_id) as (_empty, source):
        assert isinstance(source, CheckpointImages)
        plain = DirectoryImages(directory, checkpoint_id)
        assert source.size("pages-1.img") == plain.size("pages-1.img") == N * PAGE
        whole = (directory / "pages-1.img").read_bytes()
        for first, count in RUNS:
            got = bytes(source.pages("pages-1.img", first, count))
            assert got == bytes(plain.pages("pages-1.img", first, count)), (first, count)
            assert got == whole[first * PAGE:(first + count) * PAGE], (first, count)
        rng = random.Random(3)  # neighbours and jumps, as a lazy restore asks
        for _ in range(200):
            first = rng.randrange(N)
            count = rng.randrange(0, min(64, N - first) + 1)
            assert bytes(source.pages("pages-1.img", first, count)) == \
                whole[first * PAGE:(first + count) * PAGE], (first, count)


@pytest.mark.parametrize(("first", "count"), BEYOND)
def test_past_the_end_both_raise_index_error(backend: Backend, first: int, count: int) -> None:
    store, checkpoint_id, _parent = _checkpoint(backend, 5)
    with store.checkout(checkpoint_id) as directory, \
            store.checkout_streamed(checkpoint_id) as (_empty, source):
        with pytest.raises(IndexError):
            source.pages("pages-1.img", first, count)
        with pytest.raises(IndexError):
            DirectoryImages(directory, checkpoint_id).pages("pages-1.img", first, count)


def test_a_damaged_frame_raises_before_any_of_its_pages_and_others_still_read(
    backend: Backend,
) -> None:
    store = backend.store()
    pages = make_pages(["random"] * (3 * FRAME_PAGES), 7)
    rec = commit(store, backend.clock, images(pages, 7))
    [pack_id] = store.manifest(rec.id).packs
    frame = load_pack_index(backend.blobs, pack_id).frames[1]
    backend.corrupt(pack_key(pack_id), frame.offset + frame.length // 2, 0x01)
    with store.checkout_streamed(rec.id) as (_empty, source):
        for first, count in [(FRAME_PAGES + 5, 1), (FRAME_PAGES - 1, 2)]:  # in it; into it
            with pytest.raises(CorruptCheckpoint) as info:
                source.pages("pages-1.img", first, count)
            assert info.value.checkpoint_id == rec.id
            assert rec.id in info.value.message and pack_id in info.value.message
        assert bytes(source.pages("pages-1.img", 0, 3)) == b"".join(pages[:3])
        last = 3 * FRAME_PAGES - 4
        assert bytes(source.pages("pages-1.img", last, 4)) == b"".join(pages[last:])


def test_only_a_pages_image_is_read_by_page(backend: Backend) -> None:
    store = backend.store()
    rec = commit(store, backend.clock, images(make_pages(["random"] * 4, 1), 1))
    with store.checkout_streamed(rec.id) as (_empty, source), pytest.raises(KeyError):
        source.pages("core-1.img", 0, 1)
