"""Helpers of the store tests: synthetic CRIU-like image sets, stores over either backend."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.ports import BlobStore
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, Compression
from ckptd.domain import CheckpointRecord, ProcessFact, new_checkpoint_id
from ckptd.testing import FakeClock, MemoryBlobStore

PAGE = 4096
PageKind = Literal["random", "zero", "repeat", "pattern"]
PAGE_KINDS: tuple[PageKind, ...] = ("random", "zero", "repeat", "pattern")


def make_pages(kinds: Sequence[str], seed: int) -> list[bytes]:
    """One page per kind: ``random`` content, a ``zero`` page, a ``repeat`` of an earlier
    page (a fresh random one if none), or a mostly-zero ``pattern`` page."""
    rng = random.Random(seed)
    pages: list[bytes] = []
    for kind in kinds:
        if kind == "zero":
            pages.append(bytes(PAGE))
        elif kind == "repeat" and pages:
            pages.append(pages[rng.randrange(len(pages))])
        elif kind == "pattern":
            head = rng.randbytes(rng.randrange(1, 64))
            pages.append(head + bytes(PAGE - len(head)))
        else:
            pages.append(rng.randbytes(PAGE))
    return pages


def images(pages: Sequence[bytes], seed: int = 0, pid: int = 1) -> dict[str, bytes]:
    """A CRIU-like image set: ``pages-<pid>.img`` and small metadata images."""
    rng = random.Random(seed)
    return {
        f"pages-{pid}.img": b"".join(pages),
        f"pagemap-{pid}.img": rng.randbytes(48) + len(pages).to_bytes(8, "little"),
        f"core-{pid}.img": b"core" + rng.randbytes(200),
        "inventory.img": b"inventory",
    }


@dataclass
class Backend:
    """A ``BlobStore`` under test, with what the tests do to it behind the store's back."""

    name: str
    blobs: BlobStore
    clock: FakeClock
    staging: Path
    root: Path | None = None
    keys: ManifestKeys = field(default_factory=ManifestKeys.generate)
    """The manifest keys every node of this store holds (unless a test gives others)."""

    def store(
        self,
        gc_grace_s: float = 0.0,
        keys: ManifestKeys | None = None,
        compression: Compression = DEFAULT_COMPRESSION,
    ) -> ContentStore:
        """A ContentStore on these objects (a second one is a daemon restart, or another
        node sharing the storage; with other ``keys``, a node that was not given the store's
        key). GC deletes unreferenced objects at once unless given a ``gc_grace_s``
        (two-phase GC: condemn, delete a grace period later)."""
        return ContentStore(
            self.blobs,
            StagingPolicy(None, self.staging),
            clock=self.clock,
            is_pages_file=is_pages_image,
            keys=keys or self.keys,
            gc_grace_s=gc_grace_s,
            compression=compression,
        )

    def corrupt(self, key: str, offset: int, mask: int = 0xFF) -> None:
        """XOR one byte (``offset`` < 0: from the end) of a stored object with ``mask``."""
        if isinstance(self.blobs, MemoryBlobStore):
            self.blobs.corrupt(key, offset, mask)
            return
        assert self.root is not None
        path = self.root / key
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.seek(offset % size)
            byte = fh.read(1)[0]
            fh.seek(offset % size)
            fh.write(bytes([byte ^ mask]))


def make_backend(name: str, tmp: Path) -> Backend:
    clock = FakeClock()
    if name == "memory":
        return Backend(name, MemoryBlobStore(clock), clock, tmp / "staging")
    root = tmp / "objects"
    return Backend(name, LocalBlobStore(root), clock, tmp / "staging", root=root)


def record(clock: FakeClock, uid: int = 0, parent_id: str = "") -> CheckpointRecord:
    clock.advance(1)
    now = clock.time()
    return CheckpointRecord(
        id=new_checkpoint_id(now),
        pid=4321,
        created=now,
        node="node-a",
        uid=uid,
        name="job",
        processes=(ProcessFact(4321, 1, "job", ("job",), uid, uid),),
        parent_id=parent_id,
    )


def stage(store: ContentStore, rec: CheckpointRecord, files: dict[str, bytes]) -> Path:
    images_dir = store.begin(rec.id)
    for name, data in files.items():
        (images_dir / name).write_bytes(data)
    return images_dir


def commit(
    store: ContentStore,
    clock: FakeClock,
    files: dict[str, bytes],
    *,
    uid: int = 0,
    parent_id: str = "",
) -> CheckpointRecord:
    rec = record(clock, uid, parent_id)
    stage(store, rec, files)
    return store.commit(rec)


def checkout(store: ContentStore, checkpoint_id: str) -> dict[str, bytes]:
    with store.checkout(checkpoint_id) as images_dir:
        return {p.name: p.read_bytes() for p in images_dir.iterdir()}
