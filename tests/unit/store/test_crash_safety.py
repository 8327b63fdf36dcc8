"""ContentStore when writes fail, the host crashes, or another node collects garbage: a
checkpoint is listed only if it restores; leases keep a dump's fresh objects.

All over MemoryBlobStore, which can fail the N+1-th put, lose what was not flushed
(``crash``), and run another node's GC at an exact point (``on_put``); it stamps objects
with the same FakeClock the stores use, so lease ages are under the test's control.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.store.cas import ContentStore
from ckptd.core.store.condemned import CONDEMNED_PREFIX
from ckptd.core.store.index import pack_key
from ckptd.core.store.objects import LEASE_PREFIX, MANIFEST_PREFIX
from ckptd.domain import GcReport
from ckptd.errors import StoreError
from ckptd.testing import MemoryBlobStore

from .support import Backend, checkout, commit, images, make_backend, make_pages, record, stage


@pytest.fixture
def mem(tmp_path: Path) -> Backend:
    return make_backend("memory", tmp_path)


def _blobs(backend: Backend) -> MemoryBlobStore:
    assert isinstance(backend.blobs, MemoryBlobStore)
    return backend.blobs


def _files(seed: int, n: int = 40) -> dict[str, bytes]:
    return images(make_pages(["random"] * n + ["zero", "repeat", "pattern"] * 4, seed), seed)


def _puts_of_a_commit(tmp: Path) -> int:
    """How many puts a commit of ``_files`` makes (after the parent ``_files(1)``)."""
    backend = make_backend("memory", tmp / "probe")
    store = backend.store()
    parent = commit(store, backend.clock, _files(1))
    rec = record(backend.clock, parent_id=parent.id)
    stage(store, rec, _files(2))
    before = len(_blobs(backend).puts)
    store.commit(rec)
    return len(_blobs(backend).puts) - before


def _assert_clean(store: ContentStore, listed: list[str]) -> None:
    assert [r.id for r in store.list()] == listed
    report = store.verify()
    assert report.ok, report.problems
    assert sorted(report.checked) == sorted(listed)


@pytest.mark.parametrize("crash", [False, True], ids=["error", "crash"])
def test_a_commit_failing_at_any_put_leaves_nothing_visible(
    tmp_path: Path, crash: bool
) -> None:
    """For every k: the k+1-th put of a commit fails (``crash``: and the host then loses
    what was not flushed). The parent is intact, the child is not listed, the store
    verifies clean, a restarted store agrees, and a retry then succeeds."""
    n = _puts_of_a_commit(tmp_path)
    assert n >= 5  # core, pagemap, inventory, page list, pack, manifest (some shared)
    for k in range(n):
        backend = make_backend("memory", tmp_path / f"k{k}-{crash}")
        blobs = _blobs(backend)
        store = backend.store()
        parent_files = _files(1)
        parent = commit(store, backend.clock, parent_files)
        rec = record(backend.clock, parent_id=parent.id)
        stage(store, rec, _files(2))
        blobs.fail_put_after = k
        with pytest.raises(StoreError):
            store.commit(rec)
        assert blobs.failed_puts
        blobs.fail_put_after = None
        if crash:  # the host dies: only a restarted store is left
            blobs.crash()
        else:
            _assert_clean(store, [parent.id])
        restarted = backend.store()
        _assert_clean(restarted, [parent.id])
        assert checkout(restarted, parent.id) == parent_files

        # the dump is retried and now succeeds; the first instance (if alive) reads it too
        again = record(backend.clock, parent_id=parent.id)
        stage(restarted, again, _files(2))
        done = restarted.commit(again)
        assert checkout(restarted, done.id) == _files(2)
        if not crash:
            store.abort(rec.id)
            assert checkout(store, done.id) == _files(2)
        _assert_clean(backend.store(), [parent.id, done.id])


# ---- leases --------------------------------------------------------------------------------


def _crashed_dump(mem: Backend, store: ContentStore, seed: int) -> tuple[str, set[str]]:
    """A dump whose objects were written but whose manifest never was (its lease stays)."""
    rec = record(mem.clock)
    stage(store, rec, _files(seed))
    before = set(_blobs(mem).keys())
    _blobs(mem).fail_on_key_prefix = MANIFEST_PREFIX
    with pytest.raises(StoreError):
        store.commit(rec)
    _blobs(mem).fail_on_key_prefix = None
    written = set(_blobs(mem).keys()) - before
    assert any(k.startswith("packs/") for k in written)
    assert any(k.startswith(LEASE_PREFIX) for k in _blobs(mem).keys())  # noqa: SIM118
    return rec.id, written


def test_a_lease_keeps_a_dumps_objects_until_it_ends(mem: Backend) -> None:
    store = mem.store()
    cid, written = _crashed_dump(mem, store, 1)
    mem.clock.advance(3600)
    report = store.collect_garbage()
    assert report.packs_deleted == report.blobs_deleted == 0
    assert report.packs_kept >= 1
    assert written <= set(_blobs(mem).keys())

    store.abort(cid)  # the dump ends: its lease goes
    report = store.collect_garbage()
    assert report.packs_deleted >= 1
    assert not written & set(_blobs(mem).keys())
    _assert_clean(store, [])


def test_an_expired_lease_keeps_nothing(mem: Backend) -> None:
    store = mem.store()
    _cid, written = _crashed_dump(mem, store, 1)
    mem.clock.advance(6 * 3600 + 1)  # a dump that never ended (its node died)
    store.collect_garbage()
    assert not written & set(_blobs(mem).keys())
    _assert_clean(store, [])


def test_gc_from_another_node_keeps_a_dump_in_progress(mem: Backend) -> None:
    """Node B collects garbage while node A's dump has written its packs and blobs but not
    yet its manifest: A's objects are younger than its lease, so B keeps them."""
    node_a, node_b = mem.store(), mem.store()
    mem.clock.advance(3600)
    reports: list[GcReport] = []

    def gc_before_the_manifest(key: str) -> None:
        if key.startswith(MANIFEST_PREFIX) and not reports:
            reports.append(node_b.collect_garbage())

    _blobs(mem).on_put = gc_before_the_manifest
    rec = commit(node_a, mem.clock, _files(1))
    _blobs(mem).on_put = None
    assert reports
    assert reports[0].packs_deleted == 0
    assert reports[0].packs_kept >= 1
    assert checkout(node_a, rec.id) == _files(1)
    _assert_clean(mem.store(), [rec.id])


GRACE = 6 * 3600.0


def test_gc_from_another_node_keeps_old_garbage_a_dump_dedups_against(mem: Backend) -> None:
    """Node A deduplicates against a pack no manifest names any more; node B collects
    garbage before A's manifest is written. Two-phase GC: B only condemns the pack, and once
    A's manifest names it, a later GC (past the grace period) keeps it."""
    node_a, node_b = mem.store(GRACE), mem.store(GRACE)
    files = _files(1)
    old = commit(node_a, mem.clock, files)
    [old_pack] = node_a.manifest(old.id).packs
    node_a.delete(old.id)  # its pack is garbage now, but still in node A's index
    mem.clock.advance(3600)
    reports: list[GcReport] = []

    def gc_before_the_manifest(key: str) -> None:
        if key.startswith(MANIFEST_PREFIX):
            _blobs(mem).on_put = None
            reports.append(node_b.collect_garbage())

    _blobs(mem).on_put = gc_before_the_manifest
    rec = commit(node_a, mem.clock, files)
    assert reports and reports[0].packs_deleted == 0  # condemned, not deleted
    assert node_a.manifest(rec.id).packs == (old_pack,)  # A did reuse it
    assert node_a.verify(rec.id).ok
    assert checkout(node_a, rec.id) == files

    mem.clock.advance(GRACE + 1)
    report = node_b.collect_garbage()
    assert report.packs_deleted == report.blobs_deleted == 0
    assert not _condemned_keys(mem)  # named again: condemned no more
    assert checkout(node_a, rec.id) == files
    _assert_clean(mem.store(GRACE), [rec.id])


def _condemned_keys(mem: Backend) -> list[str]:
    return [k for k in _blobs(mem).keys() if k.startswith(CONDEMNED_PREFIX)]  # noqa: SIM118


def test_two_phase_gc_deletes_garbage_only_after_the_grace_period(mem: Backend) -> None:
    store = mem.store(GRACE)
    kept, gone = commit(store, mem.clock, _files(1)), commit(store, mem.clock, _files(2))
    gone_objects = {pack_key(p) for p in store.manifest(gone.id).packs}
    store.delete(gone.id)
    mem.clock.advance(3600)
    first = store.collect_garbage()
    assert first.packs_deleted == first.blobs_deleted == 0
    assert len(_condemned_keys(mem)) == 1
    assert gone_objects <= set(_blobs(mem).keys())
    mem.clock.advance(GRACE / 2)
    assert store.collect_garbage().packs_deleted == 0  # not due yet
    mem.clock.advance(GRACE / 2 + 1)
    second = store.collect_garbage()
    assert second.packs_deleted == len(gone_objects)
    assert second.blobs_deleted >= 1
    assert not gone_objects & set(_blobs(mem).keys())
    assert not _condemned_keys(mem)
    _assert_clean(store, [kept.id])
    assert checkout(store, kept.id) == _files(1)


def test_a_dump_never_reuses_a_condemned_pack(mem: Backend) -> None:
    """Node B condemned the pages of a deleted checkpoint; node A (whose index has them)
    stores them again, and B's later GC deletes only the condemned objects."""
    node_a, node_b = mem.store(GRACE), mem.store(GRACE)
    files = _files(1)
    old = commit(node_a, mem.clock, files)
    [old_pack] = node_a.manifest(old.id).packs
    node_a.delete(old.id)
    mem.clock.advance(3600)
    node_b.collect_garbage()
    assert _condemned_keys(mem)
    # the same pages and one more: a new pack, not references into the condemned one
    pages = make_pages(["random"] * 40 + ["zero", "repeat", "pattern"] * 4, 1)
    files = images([*pages, make_pages(["random"], 77)[0]], 1)
    rec = commit(node_a, mem.clock, files)
    if old_pack in node_a.manifest(rec.id).packs:  # the same pages again: the same pack,
        mtimes = dict(_blobs(mem).list("packs/"))  # written again after it became due
        assert mtimes[pack_key(old_pack)] > rec.created + GRACE
    assert rec.bytes_new > 40 * 1000  # the pages were stored again
    mem.clock.advance(GRACE + 1)
    report = node_b.collect_garbage()
    assert report.packs_deleted == 1
    assert not _blobs(mem).exists(pack_key(old_pack))
    assert checkout(node_a, rec.id) == files
    _assert_clean(mem.store(GRACE), [rec.id])


def test_a_commit_stores_again_what_became_due_while_it_ran(mem: Backend) -> None:
    """Node A's dump deduplicates against a garbage pack before any GC condemned it; while A
    ingests, node B condemns it and (a grace period later) it is due. A's re-check before its
    manifest stores those objects again: B's next GC then deletes nothing A names."""
    node_a, node_b = mem.store(GRACE), mem.store(GRACE)
    old = commit(node_a, mem.clock, _files(1))
    [old_pack] = node_a.manifest(old.id).packs
    node_a.delete(old.id)
    mem.clock.advance(3600)
    # the same pages and one more (so that the commit writes something before its manifest)
    pages = make_pages(["random"] * 40 + ["zero", "repeat", "pattern"] * 4, 1)
    files = images([*pages, make_pages(["random"], 77)[0]], 1)
    done: list[bool] = []

    def condemn_during_ingest(key: str) -> None:
        if not done and not key.startswith("leases/"):
            done.append(True)
            node_b.collect_garbage()
            mem.clock.advance(GRACE + 1)  # a very long dump: the pack is due now

    rec_ = record(mem.clock)
    stage(node_a, rec_, files)
    _blobs(mem).on_put = condemn_during_ingest
    rec = node_a.commit(rec_)
    _blobs(mem).on_put = None
    assert done
    assert rec.bytes_new > 40 * 1000  # the reused objects were stored again
    report = node_b.collect_garbage()
    assert report.packs_deleted == 0
    assert checkout(node_a, rec.id) == files
    if old_pack in node_a.manifest(rec.id).packs:  # the same pages again: the same pack,
        mtimes = dict(_blobs(mem).list("packs/"))  # written again after it became due
        assert mtimes[pack_key(old_pack)] > rec.created + GRACE
    _assert_clean(mem.store(GRACE), [rec.id])


def test_gc_with_no_grace_deletes_at_once_and_clears_condemned_lists(mem: Backend) -> None:
    store = mem.store(GRACE)
    gone = commit(store, mem.clock, _files(1))
    store.delete(gone.id)
    mem.clock.advance(3600)
    assert store.collect_garbage().packs_deleted == 0
    assert _condemned_keys(mem)
    report = store.collect_garbage(grace_s=0)
    assert report.packs_deleted == 1 and report.blobs_deleted >= 1
    assert not _condemned_keys(mem)
    assert not [k for k in _blobs(mem).keys() if k.startswith(("packs/", "blobs/"))]  # noqa: SIM118
    _assert_clean(store, [])


def test_a_damaged_condemned_list_condemns_nothing(mem: Backend) -> None:
    store = mem.store(GRACE)
    gone = commit(store, mem.clock, _files(1))
    store.delete(gone.id)
    mem.clock.advance(3600)
    store.collect_garbage()
    [key] = _condemned_keys(mem)
    _blobs(mem).put(key, b"{not json")
    mem.clock.advance(GRACE + 1)
    report = store.collect_garbage()  # condemns again, deletes nothing yet
    assert report.packs_deleted == report.blobs_deleted == 0
    assert key not in _condemned_keys(mem) and len(_condemned_keys(mem)) == 1
    mem.clock.advance(GRACE + 1)
    assert store.collect_garbage().packs_deleted == 1
    _assert_clean(store, [])


def test_a_stale_index_after_another_nodes_gc_does_not_break_a_commit(mem: Backend) -> None:
    node_a = mem.store()
    files = _files(1)
    old = commit(node_a, mem.clock, files)
    [pack_id] = node_a.manifest(old.id).packs
    node_a.delete(old.id)
    mem.clock.advance(3600)
    mem.store().collect_garbage()  # node B
    assert not _blobs(mem).exists(pack_key(pack_id))
    rec = commit(node_a, mem.clock, files)
    assert node_a.verify(rec.id).ok
    assert checkout(node_a, rec.id) == files


def test_a_stale_index_after_another_nodes_gc_does_not_break_a_restore(mem: Backend) -> None:
    node_a = mem.store()
    files = _files(1)
    old = commit(node_a, mem.clock, files)
    node_a.delete(old.id)  # node A's index still locates the pages in the old pack
    mem.clock.advance(3600)
    node_b = mem.store()
    node_b.collect_garbage()
    # the same pages and one more, in a new pack (with just the same pages, the new pack
    # would be the old one again: packs are named by their content)
    pages = make_pages(["random"] * 40 + ["zero", "repeat", "pattern"] * 4, 1)
    files = images([*pages, make_pages(["random"], 77)[0]], 1)
    rec = commit(node_b, mem.clock, files)
    assert checkout(node_b, rec.id) == files
    assert checkout(node_a, rec.id) == files
