"""A tampered store (ADR 0014): manifests swapped, replayed, edited, signed with another key
or written unauthenticated are refused by a restore and named by ``verify``; a pack's magic,
trailer and footer are checked by ``verify <id>``, the whole-store verify and every restore;
what the index finds damaged at start-up is reported for the daemon's log."""

from __future__ import annotations

import json

import pytest
import xxhash

from ckptd.core.store.cas import ContentStore
from ckptd.core.store.index import pack_key
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.objects import manifest_key
from ckptd.core.store.packs import FOOTER, MAGIC
from ckptd.errors import CorruptCheckpoint

from .support import Backend, checkout, commit, images, make_pages

pytestmark = pytest.mark.usefixtures("data_path")


def _files(seed: int) -> dict[str, bytes]:
    return images(make_pages(["random"] * 40 + ["zero"] * 4, seed), seed)


def _refused(store: ContentStore, checkpoint_id: str, *what: str) -> str:
    """The restore of ``checkpoint_id`` is refused before anything is written, with one
    line naming it and ``what``; returns that line."""
    entered = False
    with pytest.raises(CorruptCheckpoint) as info, store.checkout(checkpoint_id):
        entered = True
    assert not entered
    line = str(info.value)
    assert "\n" not in line
    assert info.value.checkpoint_id == checkpoint_id
    for w in (checkpoint_id, *what):
        assert w in line, f"{w!r} not in {line!r}"
    return line


def _verify_names(store: ContentStore, checkpoint_id: str, *what: str) -> None:
    """``verify <id>`` and the whole-store verify both name the checkpoint and ``what``."""
    for report in (store.verify(checkpoint_id), store.verify()):
        assert not report.ok
        assert any(checkpoint_id in p and all(w in p for w in what) for p in report.problems), (
            report.problems
        )


# ---- manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize("uids", [(0, 0), (1000, 2000)], ids=["same-uid", "other-uid"])
def test_a_manifest_copied_over_another_checkpoint_is_refused(
    backend: Backend, uids: tuple[int, int]
) -> None:
    store = backend.store()
    mine = commit(store, backend.clock, _files(1), uid=uids[0])
    other = commit(store, backend.clock, _files(2), uid=uids[1])
    backend.blobs.put(manifest_key(mine.id), backend.blobs.get(manifest_key(other.id)))

    for s in (store, backend.store()):  # warm cache, and a restart
        _refused(s, mine.id, f"manifest of checkpoint {other.id}", "copied over it")
        _verify_names(s, mine.id, other.id, "swapped or replayed")
        assert [r.id for r in s.list()] == [other.id]
        assert checkout(s, other.id) == _files(2)


def test_an_older_manifest_of_the_same_job_replayed_is_refused(backend: Backend) -> None:
    store = backend.store()
    older = commit(store, backend.clock, _files(1))
    newer = commit(store, backend.clock, _files(3), parent_id=older.id)
    backend.blobs.put(manifest_key(newer.id), backend.blobs.get(manifest_key(older.id)))
    _refused(backend.store(), newer.id, older.id, "swapped or replayed")
    _verify_names(backend.store(), newer.id, older.id)


def _edit(data: bytes, change: dict[str, object]) -> bytes:
    body, _, mac = data.rstrip(b"\n").rpartition(b"\n")
    raw = json.loads(body)
    raw["record"].update(change)
    return json.dumps(raw, sort_keys=True).encode() + b"\n" + mac + b"\n"


@pytest.mark.parametrize("change", [{"pid": 1}, {"uid": 0}, {"name": "other"}],
                         ids=["pid", "uid", "name"])
def test_an_edited_manifest_is_refused(backend: Backend, change: dict[str, object]) -> None:
    store = backend.store()
    rec = commit(store, backend.clock, _files(1), uid=1000)
    key = manifest_key(rec.id)
    backend.blobs.put(key, _edit(backend.blobs.get(key), change))
    for s in (store, backend.store()):
        _refused(s, rec.id, "edited", "authentication failed")
        _verify_names(s, rec.id, "edited")


def test_a_manifest_signed_with_another_key_is_refused(backend: Backend) -> None:
    stranger = backend.store(keys=ManifestKeys.generate())  # a node not given the key
    rec = commit(stranger, backend.clock, _files(1))
    store = backend.store()
    line = _refused(store, rec.id, "signed with key", "which this node does not hold")
    assert backend.keys.signing_id in line  # names the key it holds
    assert "same manifest key file" in line  # the hint
    _verify_names(store, rec.id, "does not hold")
    assert store.list() == []


def test_every_key_listed_is_accepted_and_the_first_signs(backend: Backend) -> None:
    """Rotation: a node holding (new, old) reads what either signed and signs with new."""
    old_node = backend.store()
    before = commit(old_node, backend.clock, _files(1))
    new = ManifestKeys.generate()
    rotated = backend.store(keys=ManifestKeys((new.keys[0], backend.keys.keys[0])))
    after = commit(rotated, backend.clock, _files(2))
    assert checkout(rotated, before.id) == _files(1)
    assert checkout(rotated, after.id) == _files(2)
    assert new.signing_id.encode() in backend.blobs.get(manifest_key(after.id))
    _refused(old_node, after.id, "signed with key")  # a node not given the new key yet


def _legacy(data: bytes) -> bytes:
    """``data`` rewritten as a format-1 manifest (xxh3 checksum, no MAC): what ckptd wrote
    before ADR 0014, or what an attacker without the key can write."""
    body = json.loads(data.rstrip(b"\n").rpartition(b"\n")[0])
    body = {k: v for k, v in body.items() if k not in ("id", "store")} | {"format": 1}
    raw = json.dumps(body, sort_keys=True).encode()
    return raw + b"\n" + xxhash.xxh3_128_hexdigest(raw).encode() + b"\n"


def test_an_unauthenticated_manifest_is_refused_until_adopted(backend: Backend) -> None:
    store = backend.store()
    rec = commit(store, backend.clock, _files(1))
    forged = commit(store, backend.clock, _files(2))
    key = manifest_key(rec.id)
    backend.blobs.put(key, _legacy(backend.blobs.get(key)))
    # a forged one: another checkpoint's content under rec's id is not adopted
    backend.blobs.put(manifest_key(forged.id), _legacy(backend.blobs.get(key)))

    restarted = backend.store()
    _refused(restarted, rec.id, "not authenticated")
    _verify_names(restarted, rec.id, "not authenticated")
    adoption = restarted.adopt_unauthenticated()
    assert adoption.adopted == (rec.id,)
    [why] = adoption.refused
    assert forged.id in why and rec.id in why
    assert checkout(restarted, rec.id) == _files(1)
    assert checkout(backend.store(), rec.id) == _files(1)
    assert restarted.verify(rec.id).ok
    assert restarted.adopt_unauthenticated().adopted == ()  # once


# ---- packs -------------------------------------------------------------------------------


def _pack_of(store: ContentStore, checkpoint_id: str) -> str:
    [pack_id] = store.manifest(checkpoint_id).packs
    return pack_id


PARTS = {
    "magic": (0, "bad magic"),
    "trailer": (-FOOTER.size - 1, "trailer"),
    "footer": (-FOOTER.size, "footer"),  # the trailer's offset
    "end-marker": (-1, "end marker"),
}


@pytest.mark.parametrize("part", PARTS)
def test_a_damaged_pack_structure_is_named_by_verify_and_refused_by_restore(
    backend: Backend, part: str
) -> None:
    store = backend.store()
    keep = commit(store, backend.clock, _files(1))
    hurt = commit(store, backend.clock, _files(2))
    pack_id = _pack_of(store, hurt.id)
    assert pack_id != _pack_of(store, keep.id)
    offset, what = PARTS[part]
    backend.corrupt(pack_key(pack_id), offset)

    restarted = backend.store()
    for s in (store, restarted):  # the index built before the damage, and after it
        _refused(s, hurt.id, pack_id, what)
        _verify_names(s, hurt.id, pack_id, what)
        report = s.verify(keep.id)
        assert report.ok, report.problems
        assert checkout(s, keep.id) == _files(1)
    whole = store.verify()
    assert not any(keep.id in p for p in whole.problems)
    assert any(p.startswith(pack_key(pack_id)) for p in whole.problems)
    if part != "magic":  # start-up reads the footer and trailer of every pack, not the magic
        damaged = restarted.startup_check()
        [line] = damaged.lines()
        assert pack_id in line and what in line
        assert "1 damaged" in damaged.summary()


def test_the_start_up_check_of_an_intact_store(backend: Backend) -> None:
    store = backend.store()
    commit(store, backend.clock, _files(1))
    check = backend.store().startup_check()
    assert check.damaged == ()
    assert check.packs == 1
    assert "1 pack(s) indexed" in check.summary() and "0 damaged" in check.summary()


def test_the_magic_is_what_packs_begin_with() -> None:
    assert MAGIC == b"CKPACK01"  # PARTS["magic"] flips its first byte


# ---- GC ----------------------------------------------------------------------------------


def test_gc_keeps_what_a_refused_manifest_names(backend: Backend) -> None:
    """A node given the wrong key (or a manifest not adopted yet) must not make another
    node's checkpoints garbage: GC keeps what every manifest names, authenticated or not."""
    right = backend.store()
    rec = commit(right, backend.clock, _files(1))
    legacy = commit(right, backend.clock, _files(2))
    key = manifest_key(legacy.id)
    backend.blobs.put(key, _legacy(backend.blobs.get(key)))
    wrong = backend.store(keys=ManifestKeys.generate())
    assert wrong.list() == []
    report = wrong.collect_garbage(grace_s=0)
    assert report.packs_deleted == report.blobs_deleted == 0
    assert checkout(backend.store(), rec.id) == _files(1)
    assert backend.store().adopt_unauthenticated().adopted == (legacy.id,)
    assert checkout(backend.store(), legacy.id) == _files(2)
