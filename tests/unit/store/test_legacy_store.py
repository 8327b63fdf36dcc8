"""A store written before raw frames (ckptd at e0052b0, every frame zstd: data/
make_legacy_store.py) stays restorable, byte for byte, and takes new checkpoints beside its
old ones (new pages that do not compress go into raw frames; old pages are still shared)."""

from __future__ import annotations

import hashlib
import random
import tarfile
from pathlib import Path

import pytest

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.index import pack_key
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.pagehash import PAGE_SIZE
from ckptd.testing import FakeClock

from .support import checkout, commit

pytestmark = pytest.mark.usefixtures("data_path")  # each test on the C and the Python path

DATA = Path(__file__).parent / "data" / "legacy-store-e0052b0.tar.gz"
CHECKPOINT = "ck-20240101T000000-01d0ff"
SHA256 = {
    "pages-1.img": "6fb905ad3fe586549bead82bee28a343a9140f21a8d117fb8faff1bb41f854e7",
    "pages-2.img": "1c4d28b750f83b79c4c52a5d0b72323af78d3e1e836148604501a631a0ea0abc",
    "core-1.img": "d363d216f810847bbcad1636d079929ef39a6ac7dbba4f9a59d79ad2d7bc2915",
    "inventory.img": "b11a85b296a90afc460430434a504e7acb04b064575b7277724688af0e59d189",
}


def legacy_store(tmp_path: Path) -> tuple[ContentStore, FakeClock]:
    with tarfile.open(DATA) as tar:
        tar.extractall(tmp_path, filter="data")
    clock = FakeClock()
    clock.advance(10)
    store = ContentStore(
        LocalBlobStore(tmp_path / "objects"), StagingPolicy(None, tmp_path / "staging"),
        clock=clock, is_pages_file=is_pages_image, keys=ManifestKeys.generate(),
    )
    # what the daemon does at a start with adopt_unauthenticated (the upgrade)
    assert store.adopt_unauthenticated().adopted == (CHECKPOINT,)
    return store, clock


def frame_kinds(store: ContentStore) -> list[str]:
    """'raw' or 'zstd' for every frame of every pack, by the format rule of packs.py."""
    kinds = []
    for pack in store.index.packs.values():
        for frame in pack.frames:
            kinds.append("raw" if frame.length == len(frame.hashes) * PAGE_SIZE else "zstd")
    return kinds


def test_a_checkpoint_written_before_raw_frames_restores(tmp_path: Path) -> None:
    store, _clock = legacy_store(tmp_path)
    assert frame_kinds(store) == ["zstd", "zstd"]
    pack = next(iter(store.index.packs.values()))
    incompressible = pack.frames[0]  # pages-1.img: 8 random pages in a zstd frame
    assert incompressible.length > len(incompressible.hashes) * PAGE_SIZE
    files = checkout(store, CHECKPOINT)
    assert {n: hashlib.sha256(d).hexdigest() for n, d in files.items()} == SHA256
    assert store.verify(CHECKPOINT).ok


def test_new_checkpoints_beside_old_ones(tmp_path: Path) -> None:
    store, clock = legacy_store(tmp_path)
    old = checkout(store, CHECKPOINT)
    noise = random.Random(7).randbytes(16 * PAGE_SIZE)
    files = dict(old)
    files["pages-1.img"] = old["pages-1.img"] + noise  # old pages shared, new ones raw
    new = commit(store, clock, files, uid=1000)
    assert checkout(store, new.id) == files
    assert checkout(store, CHECKPOINT) == old
    assert sorted(frame_kinds(store)) == ["raw", "zstd", "zstd"]
    assert new.bytes_new < len(noise) + 8 * PAGE_SIZE  # the old random pages are not stored again
    assert store.verify().ok
    # the raw frame is the new pages as they are
    [(pack_id, frame)] = [
        (p.pack_id, f) for p in store.index.packs.values() for f in p.frames
        if f.length == len(f.hashes) * PAGE_SIZE
    ]
    blobs = LocalBlobStore(tmp_path / "objects")
    assert blobs.get(pack_key(pack_id), frame.offset, frame.offset + frame.length) == noise
