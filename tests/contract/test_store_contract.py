"""Contract of ``CheckpointStore``: every implementation behaves the same (see core/ports/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.ports import CheckpointStore
from ckptd.domain import CheckpointRecord, ProcessFact, new_checkpoint_id
from ckptd.errors import CheckpointNotFound, StoreError

T0 = 1_700_000_000.0


def _record(created: float = T0, pid: int = 1234, **kw: object) -> CheckpointRecord:
    values: dict[str, object] = {
        "id": new_checkpoint_id(created),
        "pid": pid,
        "created": created,
        "node": "node-a",
        "uid": 1000,
        "name": "job",
        "labels": {"team": "ml"},
        "processes": (ProcessFact(pid, 1, "job", ("job", "--x"), 1000, 1000),),
    }
    values.update(kw)
    return CheckpointRecord(**values)  # type: ignore[arg-type]


def _stage(store: CheckpointStore, record: CheckpointRecord, files: dict[str, bytes]) -> Path:
    images = store.begin(record.id)
    for name, data in files.items():
        (images / name).write_bytes(data)
    return images


def _commit(
    store: CheckpointStore, record: CheckpointRecord, files: dict[str, bytes] | None = None
) -> CheckpointRecord:
    _stage(store, record, files if files is not None else {"pages-1.img": b"x" * 10})
    return store.commit(record)


def test_begin_gives_an_empty_directory(store: CheckpointStore) -> None:
    images = store.begin(new_checkpoint_id(T0))
    assert images.is_dir()
    assert list(images.iterdir()) == []


def test_begin_twice_the_same_id_fails(store: CheckpointStore) -> None:
    ckpt = new_checkpoint_id(T0)
    store.begin(ckpt)
    with pytest.raises(StoreError):
        store.begin(ckpt)


def test_record_is_invisible_before_commit_and_visible_after(store: CheckpointStore) -> None:
    record = _record()
    _stage(store, record, {"inventory.img": b"inv"})
    assert store.list() == []
    with pytest.raises(CheckpointNotFound):
        store.get(record.id)
    committed = store.commit(record)
    assert [r.id for r in store.list()] == [record.id]
    assert store.get(record.id) == committed


def test_commit_keeps_the_facts_and_fills_bytes(store: CheckpointStore) -> None:
    record = _record()
    committed = _commit(store, record, {"a.img": b"a" * 100, "b.img": b"b" * 23})
    assert committed.bytes_logical == 123  # the CRIU images it restores to
    assert 0 < committed.bytes <= 123 + 1024  # what it occupies (compressed: less)
    assert committed.bytes_new > 0  # the first checkpoint of a store adds something
    expected = record.to_json()
    got = committed.to_json()
    for key in ("bytes", "bytes_logical", "bytes_new"):
        expected.pop(key)
        got.pop(key)
    assert got == expected
    assert store.get(record.id) == committed


def test_commit_without_begin_fails(store: CheckpointStore) -> None:
    record = _record()
    with pytest.raises(StoreError):
        store.commit(record)
    assert store.list() == []


def test_commit_after_abort_fails(store: CheckpointStore) -> None:
    record = _record()
    _stage(store, record, {"a.img": b"a"})
    store.abort(record.id)
    with pytest.raises(StoreError):
        store.commit(record)
    assert store.list() == []


def test_abort_removes_staging_and_is_idempotent(store: CheckpointStore) -> None:
    record = _record()
    images = _stage(store, record, {"a.img": b"a", "b.img": b"b"})
    store.abort(record.id)
    assert not images.exists()
    store.abort(record.id)
    store.abort(new_checkpoint_id(T0))  # never begun
    assert store.list() == []
    with pytest.raises(CheckpointNotFound):
        store.get(record.id)


def test_abort_after_commit_changes_nothing(store: CheckpointStore) -> None:
    committed = _commit(store, _record())
    store.abort(committed.id)
    assert store.get(committed.id) == committed


def test_delete_removes(store: CheckpointStore) -> None:
    keep = _commit(store, _record(T0))
    gone = _commit(store, _record(T0 + 1))
    store.delete(gone.id)
    assert [r.id for r in store.list()] == [keep.id]
    with pytest.raises(CheckpointNotFound):
        store.get(gone.id)
    with pytest.raises(CheckpointNotFound):
        store.delete(gone.id)


@pytest.mark.parametrize("unknown", ["ck-20240101T000000-abcdef", "1234", "nonsense"])
def test_unknown_id_raises_checkpoint_not_found(store: CheckpointStore, unknown: str) -> None:
    _commit(store, _record())
    with pytest.raises(CheckpointNotFound) as info:
        store.get(unknown)
    assert info.value.checkpoint_id == unknown
    with pytest.raises(CheckpointNotFound):
        store.delete(unknown)
    with pytest.raises(CheckpointNotFound), store.checkout(unknown):
        pass


def test_list_is_ordered_oldest_first(store: CheckpointStore) -> None:
    """By ``created`` (not by id, nor by the order of commits or of directory entries)."""
    offsets = [30, 10, 50, 0, 40, 20, 60, 5]
    committed = {
        # ids sort against creation time, so sorting by id would give the reverse order
        off: _commit(store, _record(T0 + off, id=new_checkpoint_id(T0 + 1000 - off)))
        for off in offsets
    }
    assert [r.id for r in store.list()] == [committed[off].id for off in sorted(offsets)]


def test_list_breaks_ties_by_id(store: CheckpointStore) -> None:
    ids = sorted(new_checkpoint_id(T0 + n) for n in range(4))
    for ckpt in reversed(ids):
        _commit(store, _record(T0, id=ckpt))
    assert [r.id for r in store.list()] == ids


def test_checkout_yields_the_committed_files(store: CheckpointStore) -> None:
    files = {"inventory.img": b"inv", "pages-1.img": bytes(range(256)) * 4}
    committed = _commit(store, _record(), files)
    with store.checkout(committed.id) as images:
        assert images.is_dir()
        assert {p.name: p.read_bytes() for p in images.iterdir()} == files


def test_checkout_streamed_gives_an_empty_directory_and_the_images(
    store: CheckpointStore, tmp_path: Path
) -> None:
    files = {"inventory.img": b"inv", "pages-1.img": bytes(range(256)) * 32, "empty.img": b""}
    committed = _commit(store, _record(), files)
    with store.checkout_streamed(committed.id) as (directory, images):
        assert directory.is_dir() and not any(directory.iterdir())
        assert images.checkpoint_id == committed.id
        for name, data in files.items():
            assert images.exists(name) and images.size(name) == len(data)
            assert b"".join(bytes(c) for c in images.chunks(name)) == data
        assert not images.exists("core-1.img")
        images.write("pages-1.img", tmp_path / "pages")
        assert (tmp_path / "pages").read_bytes() == files["pages-1.img"]
    with pytest.raises(CheckpointNotFound), store.checkout_streamed("ck-20240101T000000-abcdef"):
        pass


def test_location_is_a_non_empty_string(store: CheckpointStore) -> None:
    assert isinstance(store.location, str)
    assert store.location
