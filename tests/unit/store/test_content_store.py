"""ContentStore over MemoryBlobStore and LocalBlobStore: byte-identical checkouts, dedup
against the parent, per-uid hash spaces, damage detected and never restored, GC."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store.cas import ContentStore
from ckptd.core.store.index import load_pack_index, pack_key
from ckptd.core.store.objects import blob_key, manifest_key
from ckptd.core.store.pagepath import LZ4_MAGIC, ZSTD_MAGIC, CodecName, Compression
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint

from .support import (
    PAGE,
    PAGE_KINDS,
    Backend,
    PageKind,
    checkout,
    commit,
    images,
    make_backend,
    make_pages,
)

kinds = st.lists(st.sampled_from(PAGE_KINDS), max_size=300)
pytestmark = pytest.mark.usefixtures("data_path")  # each test on the C and the Python path


def _base_pages(n: int = 256, seed: int = 1) -> list[bytes]:
    return make_pages(["random"] * n + ["zero"] * 32 + ["repeat"] * 32 + ["pattern"] * 16, seed)


@pytest.mark.parametrize("kind", ["memory", "local"])
@settings(max_examples=8, deadline=None)
@given(kinds, kinds, st.integers(0, 2**32))
def test_checkout_is_byte_identical(
    kind: str, first: list[PageKind], second: list[PageKind], seed: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = make_backend(kind, Path(tmp))
        store = backend.store()
        pages = make_pages(first, seed)
        files = images(pages, seed)
        # a second pages image sharing some pages with the first, and odd-sized images
        files["pages-2.img"] = b"".join(make_pages(second, seed + 1) + pages[:3])
        files["pages-3.img"] = b"\x01" * (PAGE + 1)  # not whole pages: stored as a blob
        files["pages-4.img"] = b""
        files["empty.img"] = b""
        rec = commit(store, backend.clock, files)
        assert checkout(store, rec.id) == files
        assert rec.bytes_logical == sum(len(d) for d in files.values())
        assert checkout(backend.store(), rec.id) == files  # after a restart
        assert store.verify(rec.id).ok
        assert store.verify().ok


def test_a_child_stores_little_and_restores_on_its_own(backend: Backend) -> None:
    store = backend.store()
    pages = _base_pages()
    first_files = images(pages)
    first = commit(store, backend.clock, first_files)
    assert first.bytes_new > 256 * PAGE  # random pages do not compress

    changed = list(pages)
    for i in (3, 50, 51, 200):
        changed[i] = make_pages(["random"], 100 + i)[0]
    child_files = images(changed)
    child = commit(store, backend.clock, child_files, parent_id=first.id)
    assert child.bytes_new < first.bytes_new / 10
    assert child.bytes_logical == first.bytes_logical
    [entry] = [f for f in store.manifest(child.id).files if f.pagelist]
    [parent_entry] = [f for f in store.manifest(first.id).files if f.pagelist]
    assert entry.pagelist_base == parent_entry.pagelist  # a delta against the full list
    assert checkout(store, child.id) == child_files
    assert checkout(store, first.id) == first_files

    store.delete(first.id)
    store.collect_garbage()
    assert [r.id for r in store.list()] == [child.id]
    assert checkout(store, child.id) == child_files
    assert store.verify().ok
    restarted = backend.store()
    assert checkout(restarted, child.id) == child_files
    assert restarted.verify().ok


def test_a_grandchild_deltas_against_the_full_list(backend: Backend) -> None:
    """A delta's base is always a full list: a chain of children decodes in two reads."""
    store = backend.store()
    pages = _base_pages(128)
    parent = commit(store, backend.clock, images(pages))
    ids = [parent.id]
    for n in range(3):
        pages = list(pages)
        pages[10 + n] = make_pages(["random"], 500 + n)[0]
        ids.append(commit(store, backend.clock, images(pages), parent_id=ids[-1]).id)
    full = next(f.pagelist for f in store.manifest(parent.id).files if f.pagelist)
    for cid in ids[1:]:
        [entry] = [f for f in store.manifest(cid).files if f.pagelist]
        assert entry.pagelist_base == full
    for cid in ids[:-1]:
        store.delete(cid)
    store.collect_garbage()
    assert checkout(store, ids[-1]) == images(pages)


def test_another_uid_does_not_dedup(backend: Backend) -> None:
    store = backend.store()
    files = images(_base_pages())
    mine = commit(store, backend.clock, files, uid=0)
    again = commit(store, backend.clock, files, uid=0)
    theirs = commit(store, backend.clock, files, uid=1000, parent_id=mine.id)
    assert again.bytes_new < mine.bytes_new / 10
    assert theirs.bytes_new > mine.bytes_new * 0.9
    assert not set(store.manifest(theirs.id).packs) & set(store.manifest(mine.id).packs)
    assert not set(store.manifest(theirs.id).blobs) & set(store.manifest(mine.id).blobs)
    assert checkout(store, theirs.id) == files


# ---- damage ------------------------------------------------------------------------------


def _two_checkpoints(backend: Backend) -> tuple[ContentStore, str, str, dict[str, bytes]]:
    """A store with two checkpoints that share no pack; the second's files."""
    store = backend.store()
    keep = commit(store, backend.clock, images(_base_pages(64, seed=1), seed=1))
    files = images(_base_pages(64, seed=2), seed=2)
    hurt = commit(store, backend.clock, files)
    assert not set(store.manifest(keep.id).packs) & set(store.manifest(hurt.id).packs)
    return store, keep.id, hurt.id, files


def _assert_never_restored(store: ContentStore, checkpoint_id: str) -> CorruptCheckpoint:
    entered = False
    with pytest.raises(CorruptCheckpoint) as info, store.checkout(checkpoint_id):
        entered = True
    assert not entered
    assert info.value.checkpoint_id == checkpoint_id
    assert checkpoint_id in str(info.value)
    return info.value


def test_a_damaged_frame_is_named_and_never_restored(backend: Backend) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    [pack_id] = store.manifest(hurt).packs
    frame = load_pack_index(backend.blobs, pack_id).frames[0]
    backend.corrupt(pack_key(pack_id), frame.offset + frame.length // 2, 0x01)

    report = store.verify(hurt)
    assert report.checked == (hurt,)
    [problem] = report.problems
    assert hurt in problem
    assert pack_id in problem
    whole = store.verify()
    assert len(whole.problems) == 1
    assert hurt in whole.problems[0]
    assert pack_id in whole.problems[0]
    _assert_never_restored(store, hurt)
    _assert_never_restored(backend.store(), hurt)
    assert store.verify(keep).ok
    checkout(store, keep)


def test_a_damaged_metadata_image_is_named_and_never_restored(backend: Backend) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    [core] = [f for f in store.manifest(hurt).files if f.name == "core-1.img"]
    backend.corrupt(blob_key(core.blob), -3, 0x01)
    [problem] = store.verify(hurt).problems
    assert hurt in problem
    assert core.blob in problem
    _assert_never_restored(store, hurt)
    assert store.verify(keep).ok


def test_a_damaged_manifest_hides_the_checkpoint_and_is_never_restored(
    backend: Backend,
) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    backend.corrupt(manifest_key(hurt), 20, 0x01)

    _assert_never_restored(store, hurt)  # checkout re-reads the manifest
    restarted = backend.store()
    assert [r.id for r in restarted.list()] == [keep]
    with pytest.raises(CorruptCheckpoint) as info:
        restarted.get(hurt)
    assert info.value.checkpoint_id == hurt
    _assert_never_restored(restarted, hurt)
    report = restarted.verify()
    assert set(report.checked) == {keep, hurt}
    [problem] = report.problems
    assert hurt in problem
    assert "manifest" in problem
    [problem] = restarted.verify(hurt).problems
    assert hurt in problem
    assert restarted.verify(keep).ok


def test_a_checkpoint_with_a_damaged_manifest_can_be_deleted(backend: Backend) -> None:
    _store, keep, hurt, _files = _two_checkpoints(backend)
    backend.corrupt(manifest_key(hurt), 20, 0x01)
    restarted = backend.store()
    restarted.delete(hurt)
    assert not backend.blobs.exists(manifest_key(hurt))
    assert restarted.verify().ok
    with pytest.raises(CheckpointNotFound):
        restarted.get(hurt)
    assert [r.id for r in restarted.list()] == [keep]


def test_a_missing_pack_is_named_and_never_restored(backend: Backend) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    [pack_id] = store.manifest(hurt).packs
    backend.blobs.delete(pack_key(pack_id))
    [problem] = store.verify(hurt).problems
    assert hurt in problem
    assert pack_id in problem
    assert "missing" in problem
    _assert_never_restored(store, hurt)
    restarted = backend.store()
    assert not restarted.verify(hurt).ok
    _assert_never_restored(restarted, hurt)
    assert restarted.verify(keep).ok
    checkout(restarted, keep)


def test_a_missing_page_list_is_named_and_never_restored(backend: Backend) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    [entry] = [f for f in store.manifest(hurt).files if f.pagelist]
    backend.blobs.delete(blob_key(entry.pagelist))
    [problem] = store.verify(hurt).problems
    assert hurt in problem
    assert entry.pagelist in problem
    _assert_never_restored(store, hurt)
    assert store.verify(keep).ok


def test_a_damaged_pack_trailer_does_not_make_the_store_unusable(backend: Backend) -> None:
    store, keep, hurt, _files = _two_checkpoints(backend)
    keep_files = checkout(store, keep)
    [pack_id] = store.manifest(hurt).packs
    backend.corrupt(pack_key(pack_id), -40, 0x01)  # inside the trailer
    restarted = backend.store()
    assert checkout(restarted, keep) == keep_files
    assert any(pack_id in p for p in restarted.verify().problems)
    _assert_never_restored(restarted, hurt)


def _blob_with_a_huge_declared_size(backend: Backend) -> tuple[ContentStore, str]:
    """A checkpoint whose core image blob, after one flipped bit (its zstd header's
    Frame_Content_Size flag: 2 -> 8 bytes), declares between 2**58 and 2**62 bytes (more
    than any address space: the allocation fails at once)."""
    store = backend.store()
    for seed in range(200):
        files = images(make_pages(["random"], seed), seed)
        files["core-1.img"] = make_pages(["random"], seed + 1000)[0][:3000]
        rec = commit(store, backend.clock, files)
        [core] = [f for f in store.manifest(rec.id).files if f.name == "core-1.img"]
        key = blob_key(core.blob)
        backend.corrupt(key, 4, 0x80)
        size = zstandard.frame_content_size(backend.blobs.get(key))
        if 2**58 <= size < 2**62:
            return store, rec.id
        backend.corrupt(key, 4, 0x80)
    raise AssertionError("no such blob")


def test_a_damaged_blob_header_is_named_by_verify(backend: Backend) -> None:
    store, cid = _blob_with_a_huge_declared_size(backend)
    assert cid in store.verify(cid).problems[0]


# ---- garbage collection ------------------------------------------------------------------


def test_gc_frees_what_only_a_deleted_checkpoint_needed(backend: Backend) -> None:
    store, keep, gone, _files = _two_checkpoints(backend)
    keep_files = checkout(store, keep)
    [pack_id] = store.manifest(gone).packs
    pack_size = backend.blobs.size(pack_key(pack_id))
    assert store.collect_garbage().bytes_freed == 0  # nothing is garbage yet

    report = store.collect_garbage(delete_first=(gone,))
    assert report.deleted_checkpoints == (gone,)
    assert report.packs_deleted == 1
    assert report.blobs_deleted >= 3  # page list, core, pagemap
    assert report.bytes_freed >= pack_size
    assert not backend.blobs.exists(pack_key(pack_id))
    assert [r.id for r in store.list()] == [keep]
    assert store.verify().ok
    assert checkout(store, keep) == keep_files
    restarted = backend.store()
    assert restarted.verify().ok
    assert checkout(restarted, keep) == keep_files
    again = store.collect_garbage()
    assert (again.packs_deleted, again.blobs_deleted, again.bytes_freed) == (0, 0, 0)


def test_gc_keeps_what_a_surviving_child_shares(backend: Backend) -> None:
    store = backend.store()
    pages = _base_pages(64)
    parent = commit(store, backend.clock, images(pages))
    pages[0] = make_pages(["random"], 99)[0]
    child = commit(store, backend.clock, images(pages), parent_id=parent.id)
    report = store.collect_garbage(delete_first=(parent.id,))
    assert report.packs_deleted == 0  # the child needs the parent's pages
    assert checkout(store, child.id) == images(pages)
    assert store.verify().ok


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_either_codec_checks_out_verifies_and_names_a_damaged_frame(
    backend: Backend, codec: CodecName
) -> None:
    """Issue 35: a store writing LZ4 frames (or zstd at a fast level) checks out byte for
    byte, its frames are of that codec, and a damaged one is named, never restored."""
    compression = Compression(codec, -2)
    store = backend.store(compression=compression)
    pages = make_pages(["pattern"] * 200 + ["random"] * 20 + ["zero"] * 10, 3)
    files = images(pages, 3)
    rec = commit(store, backend.clock, files)
    assert checkout(store, rec.id) == files
    assert checkout(backend.store(), rec.id) == files  # read by a node writing zstd
    [pack_id] = store.manifest(rec.id).packs
    frames = load_pack_index(backend.blobs, pack_id).frames
    stored = backend.blobs.get(pack_key(pack_id))
    magic = LZ4_MAGIC if codec == "lz4" else ZSTD_MAGIC
    assert any(stored[f.offset : f.offset + 4] == magic for f in frames)
    assert store.verify(rec.id).ok
    squeezed = next(f for f in frames if stored[f.offset : f.offset + 4] == magic)
    backend.corrupt(pack_key(pack_id), squeezed.offset + squeezed.length // 2, 0x01)
    [problem] = store.verify(rec.id).problems
    assert pack_id in problem
    _assert_never_restored(store, rec.id)


def test_a_store_switched_to_lz4_reads_its_zstd_checkpoints_and_dedups_against_them(
    backend: Backend,
) -> None:
    """Frames say their codec: changing ``compression`` needs no rewrite; a child written
    with LZ4 stores only its changed pages against its zstd parent, and both check out."""
    pages = _base_pages()
    parent = commit(backend.store(), backend.clock, images(pages))
    lz4_store = backend.store(compression=Compression("lz4", 0))
    changed = [*pages[:-8], *make_pages(["pattern"] * 8, 9)]
    child = commit(lz4_store, backend.clock, images(changed), parent_id=parent.id)
    assert child.bytes_new < parent.bytes_new / 10
    assert checkout(lz4_store, parent.id) == images(pages)
    assert checkout(backend.store(), child.id) == images(changed)
