"""GC compaction (docs/adr/0018-store-compaction.md): packs mostly garbage are rewritten, so a
store whose checkpoints rewrite scattered pages stops growing; every listed checkpoint stays
restorable and verifiable through a compaction that fails or crashes at any write, and on
another node whose index predates it."""

from __future__ import annotations

import errno
import random
import re
from pathlib import Path

import pytest

from ckptd.core.store.cas import ContentStore
from ckptd.core.store.compact import COMPACT_LEASE_PREFIX
from ckptd.core.store.condemned import CONDEMNED_PREFIX
from ckptd.core.store.index import PACK_PREFIX
from ckptd.domain import GcReport
from ckptd.errors import StoreError
from ckptd.testing import MemoryBlobStore

from .support import Backend, checkout, commit, images, make_backend, make_pages

PAGE = 4096


def _churn(backend: Backend, store: ContentStore, *, steps: int = 6, pages: int = 300,
           rewrite: float = 0.4, keep: int = 2) -> tuple[list[str], dict[str, dict[str, bytes]]]:
    """Checkpoints of a job that rewrites a scattered ``rewrite`` share of its pages between
    dumps; all but the newest ``keep`` deleted. Returns the kept ids and their images."""
    rng = random.Random(7)
    current = make_pages(["random"] * pages, 1)
    ids: list[str] = []
    files: dict[str, dict[str, bytes]] = {}
    parent = ""
    for step in range(steps):
        if step:
            fresh = make_pages(["random"] * pages, 100 + step)
            for i in rng.sample(range(pages), int(pages * rewrite)):
                current[i] = fresh[i]
        imgs = images(current, seed=step)
        rec = commit(store, backend.clock, imgs, parent_id=parent)
        ids.append(rec.id)
        files[rec.id] = imgs
        parent = rec.id
    for old in ids[:-keep]:
        store.delete(old)
        del files[old]
    return ids[-keep:], files


def _pack_bytes(backend: Backend) -> int:
    return sum(backend.blobs.size(k) for k, _ in backend.blobs.list(PACK_PREFIX))


def _unique_bytes(store: ContentStore, ids: list[str]) -> int:
    """The distinct non-zero pages of ``ids`` (they do not compress: random)."""
    pages: set[bytes] = set()
    for cid in ids:
        for refs in store.page_refs(cid).values():
            pages.update(refs)
    pages.discard(bytes(16))
    return len(pages) * PAGE


def _assert_all_restore(store: ContentStore, files: dict[str, dict[str, bytes]]) -> None:
    assert sorted(r.id for r in store.list()) == sorted(files)
    report = store.verify()
    assert report.ok, report.problems
    for cid, imgs in files.items():
        assert checkout(store, cid) == imgs


def test_gc_without_compaction_frees_nothing_a_live_page_pins(backend: Backend) -> None:
    """The problem (issue 24, 4): one live page pins its whole pack."""
    store = backend.store()
    kept, _files = _churn(backend, store)
    report = store.collect_garbage(compact_below=0)
    assert report.packs_rewritten == 0
    assert _pack_bytes(backend) > 2 * _unique_bytes(store, kept)


def test_gc_compacts_packs_mostly_garbage(backend: Backend) -> None:
    store = backend.store()
    kept, files = _churn(backend, store)
    before = _pack_bytes(backend)
    report = store.collect_garbage()
    assert report.packs_rewritten >= 3 and report.packs_written >= 1, report
    assert report.bytes_freed > 0 and report.bytes_freed >= report.bytes_rewritten
    after = _pack_bytes(backend)
    assert after < before
    assert after <= 1.5 * _unique_bytes(store, kept), (after, _unique_bytes(store, kept))
    assert {p.checkpoint_id for p in report.pinned} == set(kept)
    assert sum(p.bytes_alone for p in report.pinned) <= after
    assert all(p.bytes > 0 and p.packs > 0 for p in report.pinned)
    _assert_all_restore(store, files)
    _assert_all_restore(backend.store(), files)  # a restart: the index rebuilt from packs
    assert not list(backend.blobs.list(COMPACT_LEASE_PREFIX))
    again = store.collect_garbage()
    assert (again.packs_rewritten, again.bytes_freed) == (0, 0)


def test_compacted_packs_wait_for_the_grace_period(mem: Backend) -> None:
    """Another node may be reading an old pack: it is only condemned, deleted a grace period
    later; meanwhile both copies restore."""
    store = mem.store(gc_grace_s=100.0)
    kept, files = _churn(mem, store)
    first = store.collect_garbage()
    assert first.packs_rewritten >= 3 and first.bytes_freed == 0
    assert first.bytes_condemned >= first.bytes_rewritten
    _assert_all_restore(store, files)
    mem.clock.advance(101)
    second = store.collect_garbage()
    assert second.bytes_freed >= first.bytes_rewritten
    assert _pack_bytes(mem) <= 1.5 * _unique_bytes(store, kept)
    _assert_all_restore(store, files)


def test_a_node_whose_index_predates_the_compaction_restores(mem: Backend) -> None:
    store = mem.store()
    _kept, files = _churn(mem, store)
    other = mem.store()  # another node: its index locates pages in the old packs
    assert store.collect_garbage().packs_rewritten >= 3
    for cid, imgs in files.items():
        assert checkout(other, cid) == imgs
    assert other.verify().ok


def _puts_of_compaction(tmp: Path) -> int:
    backend = make_backend("memory", tmp / "probe")
    store = backend.store()
    _churn(backend, store)
    blobs = backend.blobs
    assert isinstance(blobs, MemoryBlobStore)
    before = len(blobs.puts)
    assert store.collect_garbage().packs_rewritten
    return len(blobs.puts) - before


@pytest.fixture
def mem(tmp_path: Path) -> Backend:
    return make_backend("memory", tmp_path)


@pytest.mark.parametrize("crash", [False, True], ids=["error", "crash"])
def test_a_compaction_failing_at_any_put_leaves_every_checkpoint_restorable(
    tmp_path: Path, crash: bool
) -> None:
    puts = _puts_of_compaction(tmp_path)
    assert puts >= 3  # lease, a pack, manifests
    for n in range(puts):
        backend = make_backend("memory", tmp_path / f"n{n}")
        store = backend.store()
        _kept, files = _churn(backend, store)
        blobs = backend.blobs
        assert isinstance(blobs, MemoryBlobStore)
        blobs.fail_put_after = n
        with pytest.raises(StoreError):
            store.collect_garbage()
        blobs.fail_put_after = None
        if crash:
            blobs.crash()
        restarted = backend.store()
        restarted.clean()  # what the daemon does at start: the compaction's lease goes
        _assert_all_restore(restarted, files)
        assert restarted.collect_garbage().bytes_freed > 0, n
        _assert_all_restore(restarted, files)
        assert _pack_bytes(backend) <= 1.5 * _unique_bytes(restarted, list(files)), n


# ---- a full store (issue 33, point 3): what needs no new space is freed first -----------------


def _dead_pack(backend: Backend, store: ContentStore) -> int:
    """A small checkpoint no other shares a page with, deleted: its pack is wholly dead.
    Returns that pack's size."""
    before = {k for k, _ in backend.blobs.list(PACK_PREFIX)}
    rec = commit(store, backend.clock, images(make_pages(["random"] * 8, 999), seed=99))
    store.delete(rec.id)
    (key,) = {k for k, _ in backend.blobs.list(PACK_PREFIX)} - before
    return backend.blobs.size(key)


def _skipped_line(report: GcReport, why: str = "No space left on device") -> int:
    """The one line a full store leaves in the report; returns the bytes it says were freed
    first."""
    (line,) = report.skipped
    found = re.fullmatch(
        rf"compaction skipped: the store's filesystem is full \({why}\); freed (\d+) bytes "
        r"first; run gc again once there is room", line)
    assert found, line
    return int(found[1])


def test_gc_on_a_full_store_frees_dead_packs_first_and_skips_compaction(mem: Backend) -> None:
    """The store's file system full: compaction (it writes new packs first) cannot run, the
    dead pack is freed all the same, nothing compaction began is left behind; once there is
    room, the next gc compacts."""
    store = mem.store()
    kept, files = _churn(mem, store)
    dead = _dead_pack(mem, store)
    blobs = mem.blobs
    assert isinstance(blobs, MemoryBlobStore)
    keys_before, total_before = set(blobs.keys()), blobs.total_bytes()
    blobs.capacity = total_before  # full: not one byte more

    report = store.collect_garbage()
    freed_first = _skipped_line(report)
    assert freed_first >= dead and report.packs_deleted >= 1, report
    assert report.bytes_freed >= freed_first
    assert (report.packs_rewritten, report.packs_written) == (0, 0)
    assert blobs.failed_puts, "compaction never tried to write: the test proves nothing"
    # nothing compaction wrote before it stopped stays: no lease, no new pack
    assert set(blobs.keys()) <= keys_before
    assert blobs.total_bytes() == total_before - report.bytes_freed
    _assert_all_restore(store, files)
    _assert_all_restore(mem.store(), files)

    blobs.capacity = None  # room again
    again = store.collect_garbage()
    assert again.skipped == ()
    assert again.packs_rewritten >= 3 and again.bytes_freed > 0, again
    assert _pack_bytes(mem) <= 1.5 * _unique_bytes(store, kept)
    _assert_all_restore(store, files)


def test_gc_without_compaction_writes_nothing(mem: Backend) -> None:
    """``compact=False`` (``ckptctl gc --no-compact``): the dead pack freed, no pack
    rewritten, not one object written."""
    store = mem.store()
    _kept, files = _churn(mem, store)
    dead = _dead_pack(mem, store)
    blobs = mem.blobs
    assert isinstance(blobs, MemoryBlobStore)
    puts = len(blobs.puts)
    report = store.collect_garbage(compact=False)
    assert report.bytes_freed >= dead and report.packs_deleted >= 1, report
    assert (report.packs_rewritten, report.packs_written, report.skipped) == (0, 0, ())
    assert len(blobs.puts) == puts
    _assert_all_restore(store, files)
    assert store.collect_garbage().packs_rewritten >= 3  # there was something to compact


@pytest.mark.parametrize("crash", [False, True], ids=["full", "full-then-crash"])
def test_a_store_filling_up_at_any_write_of_gc_loses_nothing(
    tmp_path: Path, crash: bool
) -> None:
    """ENOSPC (or EDQUOT) from the n-th write of a gc on, for every n: the gc frees what it
    can and says compaction was skipped, every listed checkpoint restores (after a crash
    too), and once there is room a gc compacts the store as if nothing had happened."""
    puts = _puts_of_compaction(tmp_path)
    for n in range(puts):
        code, why = ((errno.ENOSPC, "No space left on device") if n % 2 else
                     (errno.EDQUOT, "Disk quota exceeded"))
        backend = make_backend("memory", tmp_path / f"n{n}")
        store = backend.store()
        _kept, files = _churn(backend, store)
        blobs = backend.blobs
        assert isinstance(blobs, MemoryBlobStore)
        blobs.fail_put_after, blobs.fail_errno = n, code
        report = store.collect_garbage()
        _skipped_line(report, why)
        assert not list(blobs.list(COMPACT_LEASE_PREFIX)), n
        blobs.fail_put_after = None
        if crash:
            blobs.crash()
        restarted = backend.store()
        restarted.clean()
        _assert_all_restore(restarted, files)
        assert restarted.collect_garbage().skipped == ()
        _assert_all_restore(restarted, files)
        assert _pack_bytes(backend) <= 1.5 * _unique_bytes(restarted, list(files)), n


def test_a_full_store_with_a_grace_period_condemns_in_the_room_a_delete_left(
    mem: Backend,
) -> None:
    """Two-phase GC on a full store: with not one byte of room the condemned list cannot be
    written (one more line says so; nothing is deleted on its account), in the little room
    a deleted manifest leaves it is, and a gc after the grace period frees the dead pack."""
    store = mem.store(gc_grace_s=100.0)
    _kept, files = _churn(mem, store)
    dead = _dead_pack(mem, store)
    blobs = mem.blobs
    assert isinstance(blobs, MemoryBlobStore)
    blobs.capacity = blobs.total_bytes()

    first = store.collect_garbage()
    assert (first.bytes_freed, first.bytes_condemned) == (0, 0), first
    assert [line.split(":")[0] for line in first.skipped] == [
        "condemning skipped", "compaction skipped"], first.skipped
    assert not list(blobs.list(CONDEMNED_PREFIX))
    _assert_all_restore(store, files)

    blobs.capacity = blobs.total_bytes() + 4096  # what deleting a small manifest frees
    second = store.collect_garbage()
    assert second.bytes_condemned >= dead and second.bytes_freed == 0, second
    _skipped_line(second)
    mem.clock.advance(101)
    third = store.collect_garbage()
    assert third.bytes_freed >= dead and third.packs_deleted >= 1, third
    _assert_all_restore(store, files)
