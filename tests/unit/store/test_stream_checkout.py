"""``ContentStore.checkout_streamed``: every image read in order, byte for byte what a checkout
writes, a few frames held at a time; damage met mid-image raises, naming the checkpoint and the
object, after only verified bytes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.ports import ImageSource
from ckptd.core.store import reader, restream
from ckptd.core.store.cas import ContentStore
from ckptd.core.store.index import load_pack_index, pack_key
from ckptd.errors import CorruptCheckpoint

from .support import PAGE_KINDS, Backend, PageKind, commit, images, make_backend, make_pages

kinds = st.lists(st.sampled_from(PAGE_KINDS), max_size=300)
pytestmark = pytest.mark.usefixtures("data_path")  # each test on the C and the Python path


def read_all(source: ImageSource, name: str) -> bytes:
    return b"".join(bytes(c) for c in source.chunks(name))


def streamed(store: ContentStore, checkpoint_id: str, names: list[str]) -> dict[str, bytes]:
    with store.checkout_streamed(checkpoint_id) as (directory, source):
        assert directory.is_dir() and not any(directory.iterdir())
        assert source.checkpoint_id == checkpoint_id
        return {n: read_all(source, n) for n in names if source.exists(n)}


@pytest.mark.parametrize("budget", [1, restream.FRAME_BUDGET])
@settings(max_examples=6, deadline=None)
@given(kinds, kinds, st.integers(0, 2**32))
def test_streamed_images_are_the_checkout_s_bytes(
    budget: int, first: list[PageKind], second: list[PageKind], seed: int
) -> None:
    """A parent and a child that shares some of its pages (so the child's image jumps between
    the parent's frames and its own, back and forth): each image streamed is the image, also
    with one frame held at a time (frames read again when the image comes back to them)."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(restream, "FRAME_BUDGET", budget)
        backend = make_backend("local", Path(tmp))
        store = backend.store()
        pages = make_pages(first, seed)
        parent = images(pages, seed)
        parent["pages-3.img"] = b"\x01" * 5000  # not whole pages: a blob
        parent["empty.img"] = b""
        rec = commit(store, backend.clock, parent)
        mixed = make_pages(second, seed + 1)
        child = dict(parent)
        child["pages-1.img"] = b"".join(
            p for pair in zip(pages[::-1], mixed, strict=False) for p in pair) + bytes(8192)
        rec2 = commit(store, backend.clock, child, parent_id=rec.id)
        for ck, files in ((rec, parent), (rec2, child)):
            assert streamed(store, ck.id, [*files, "absent.img"]) == files
            assert streamed(backend.store(), ck.id, list(files)) == files  # after a restart


def _one_checkpoint(backend: Backend) -> tuple[ContentStore, str, bytes]:
    store = backend.store()
    pages = make_pages(["random"] * 3000, 7)  # three frames of one pack
    files = images(pages, 7)
    rec = commit(store, backend.clock, files)
    return store, rec.id, files["pages-1.img"]


def test_a_damaged_frame_stops_the_stream_after_verified_bytes_only(backend: Backend) -> None:
    store, checkpoint_id, want = _one_checkpoint(backend)
    [pack_id] = store.manifest(checkpoint_id).packs
    frame = load_pack_index(backend.blobs, pack_id).frames[1]
    backend.corrupt(pack_key(pack_id), frame.offset + frame.length // 2, 0x01)
    got = bytearray()
    with store.checkout_streamed(checkpoint_id) as (_dir, source), \
            pytest.raises(CorruptCheckpoint) as info:
        for chunk in source.chunks("pages-1.img"):
            got += chunk
    assert checkpoint_id in info.value.message and pack_id in info.value.message
    assert "frame 1" in info.value.message
    assert info.value.checkpoint_id == checkpoint_id
    assert len(got) == 1024 * 4096 and bytes(got) == want[: len(got)]  # frame 0, verified


def test_a_missing_pack_stops_the_stream_naming_it(backend: Backend) -> None:
    store, checkpoint_id, _want = _one_checkpoint(backend)
    [pack_id] = store.manifest(checkpoint_id).packs
    with store.checkout_streamed(checkpoint_id) as (_dir, source):
        backend.blobs.delete(pack_key(pack_id))  # gone after the store indexed it
        with pytest.raises(CorruptCheckpoint) as info:
            read_all(source, "pages-1.img")
        assert read_all(source, "inventory.img") == b"inventory"
    assert checkpoint_id in info.value.message
    assert f"pack {pack_id} is missing" in info.value.message


def test_gc_waits_for_a_streamed_checkout(backend: Backend) -> None:
    """The packs are read while CRIU restores: the store's lock is held meanwhile."""
    store, checkpoint_id, _want = _one_checkpoint(backend)
    with store.checkout_streamed(checkpoint_id):
        assert store.rw._readers == 1
    assert store.rw._readers == 0


def test_open_images_share_the_frame_budget(backend: Backend) -> None:
    """Many pages images read at once (a tree's processes): each holds fewer frames ahead,
    never fewer than one, and all of them are still the checkout's bytes."""
    store = backend.store()
    files = {f"pages-{i}.img": b"".join(make_pages(["random"] * 40, i)) for i in range(1, 41)}
    rec = commit(store, backend.clock, files)
    with store.checkout_streamed(rec.id) as (_dir, source):
        assert isinstance(source, restream.CheckpointImages)
        assert source._window() == reader.PREFETCH
        streams = {name: source.chunks(name) for name in files}
        firsts = {name: bytes(next(it)) for name, it in streams.items()}  # all 40 open
        assert source._window() == 1  # 64 frames shared by 40 images
        for name, it in streams.items():
            assert firsts[name] + b"".join(bytes(c) for c in it) == files[name]
        assert source._window() == reader.PREFETCH
