"""Reading a checkpoint back: every byte verified against its hash on the way out.

Each frame a file needs is fetched, decompressed (unless stored raw) and verified exactly once,
a few ahead of need on an executor (both without the GIL: zstd, ``pagepath``); runs of
consecutive pages are written from views into the frame with ``pwrite``, into a sparse file
(zero pages are never written).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagelist
from ckptd.core.store.index import Location, PageIndex, pack_key
from ckptd.core.store.manifest import FileEntry, Manifest
from ckptd.core.store.objects import get_blob
from ckptd.core.store.packs import read_frame_data
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.errors import BlobNotFound, CorruptCheckpoint

PREFETCH = 6

FrameKey = tuple[str, int]


def _runs(locs: Sequence[Location | None]) -> Iterator[tuple[FrameKey | None, int, int]]:
    """Coalesce page locations into runs: (frame, first index, count) of consecutive pages of
    one frame, or (None, 0, count) for zero pages."""
    key: FrameKey | None = None
    first = count = 0
    for loc in locs:
        if loc is None:
            if key is None and count:
                count += 1
                continue
            if count:
                yield key, first, count
            key, first, count = None, 0, 1
            continue
        k = (loc.pack_id, loc.frame)
        if count and key == k and loc.index == first + count:
            count += 1
            continue
        if count:
            yield key, first, count
        key, first, count = k, loc.index, 1
    if count:
        yield key, first, count


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class PageSource:
    """Pages of one store, located through its index: each frame fetched, decompressed and
    verified once per request. Raises CorruptCheckpoint naming ``checkpoint_id`` and the
    damaged object on any mismatch; writes nothing unverified."""

    def __init__(
        self,
        blobs: BlobStore,
        index: PageIndex,
        hasher: PageHasher,
        executor: Executor,
        checkpoint_id: str,
        packs: Sequence[str] = (),
    ) -> None:
        self._blobs = blobs
        self._index = index
        self._hasher = hasher
        self._executor = executor
        self._id = checkpoint_id
        self._packs = packs

    def write_pages(
        self, refs: Sequence[bytes], path: Path, skip: frozenset[int] = frozenset()
    ) -> None:
        """Write the pages ``refs`` into ``path`` (created if missing, sized to ``refs``; zero
        pages and the indices in ``skip`` are not written: the caller wrote those)."""
        runs = self._plan([ZERO_REF if i in skip else r for i, r in enumerate(refs)])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, len(refs) * PAGE_SIZE)
            self._write_runs(fd, runs)
        finally:
            os.close(fd)

    def _write_runs(self, fd: int, runs: dict[FrameKey, list[tuple[int, int, int]]]) -> None:
        for key, frame in self._frames_once(list(runs)):
            view = memoryview(frame)
            for dst, src, count in runs[key]:
                _pwrite_all(fd, view[src * PAGE_SIZE : (src + count) * PAGE_SIZE],
                            dst * PAGE_SIZE)
            view.release()

    def _plan(self, refs: Sequence[bytes]) -> dict[FrameKey, list[tuple[int, int, int]]]:
        """For each frame ``refs`` need: (page in the file, index in the frame, count) of
        every run of consecutive pages it supplies. Zero pages need no frame."""
        runs: dict[FrameKey, list[tuple[int, int, int]]] = {}
        out = 0
        for key, first, count in _runs([None if r == ZERO_REF else self._locate(r) for r in refs]):
            if key is not None:
                runs.setdefault(key, []).append((out, first, count))
            out += count
        return runs

    def _frames_once(self, keys: list[FrameKey]) -> Iterator[tuple[FrameKey, bytes]]:
        """Each frame of ``keys`` loaded and verified, a bounded number at a time in flight."""
        ahead: deque[tuple[FrameKey, Future[bytes]]] = deque()
        try:
            for key in keys:
                ahead.append((key, self._executor.submit(self._load_frame, *key)))
                if len(ahead) >= PREFETCH:
                    k, future = ahead.popleft()
                    yield k, future.result()
            while ahead:
                k, future = ahead.popleft()
                yield k, future.result()
        finally:
            for _, future in ahead:
                future.cancel()

    def _locate(self, ref: bytes) -> Location:
        loc = self._index.get(ref)
        if loc is None:
            self._index.refresh(self._blobs)
            loc = self._index.get(ref)
        if loc is None:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page {ref.hex()} is in no pack ({self._lost_packs()})",
                checkpoint_id=self._id,
            )
        return loc

    def _lost_packs(self) -> str:
        """Which of the checkpoint's packs the index lacks, and why: the damaged object to
        name when a page cannot be found."""
        lost = [
            self._index.damaged.get(p) or f"pack {p} is missing"
            for p in self._packs
            if p not in self._index.packs
        ]
        return "; ".join(lost) or "a pack is missing"

    def _load_frame(self, pack_id: str, frame_no: int) -> bytes:
        pack = self._index.packs[pack_id]
        frame = pack.frames[frame_no]
        try:
            raw = self._blobs.get(pack_key(pack_id), frame.offset, frame.offset + frame.length)
        except BlobNotFound as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: pack {pack_id} is missing", checkpoint_id=self._id
            ) from exc
        try:
            return read_frame_data(pack_id, frame_no, raw, frame.hashes, self._hasher)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: {exc.message}", checkpoint_id=self._id
            ) from exc


class CheckpointReader(PageSource):
    """Streams the files of one checkpoint, every byte verified."""

    def __init__(
        self,
        blobs: BlobStore,
        index: PageIndex,
        manifest: Manifest,
        hasher: PageHasher,
        executor: Executor,
    ) -> None:
        super().__init__(blobs, index, hasher, executor, manifest.record.id, manifest.packs)
        self._m = manifest

    def refs(self, entry: FileEntry) -> list[bytes]:
        data = get_blob(self._blobs, self._hasher, entry.pagelist, self._id)
        base: Sequence[bytes] | None = None
        if entry.pagelist_base:
            base_data = get_blob(self._blobs, self._hasher, entry.pagelist_base, self._id)
            base = pagelist.decode(base_data)
        try:
            return pagelist.decode(data, base)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page list of {entry.name} is damaged ({exc.message})",
                checkpoint_id=self._id,
            ) from exc

    def sized_refs(self, entry: FileEntry) -> list[bytes]:
        """``refs``, checked against the file's size."""
        refs = self.refs(entry)
        if len(refs) * PAGE_SIZE != entry.size:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page list of {entry.name} does not match its size",
                checkpoint_id=self._id,
            )
        return refs

    def blob(self, entry: FileEntry) -> bytes:
        """The content of an image stored whole, verified and checked against its size."""
        data = get_blob(self._blobs, self._hasher, entry.blob, self._id)
        if len(data) != entry.size:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: {entry.name} has {len(data)} bytes, "
                f"expected {entry.size}",
                checkpoint_id=self._id,
            )
        return data

    def materialize(self, entry: FileEntry, path: Path) -> None:
        """Write ``entry``'s file at ``path``: every needed frame is fetched, decompressed and
        verified exactly once (in parallel), and its pages copied to where they belong; zero
        pages are never written (the file is created sparse)."""
        if entry.blob:
            path.write_bytes(self.blob(entry))
            return
        runs = self._plan(self.sized_refs(entry))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, entry.size)
            self._write_runs(fd, runs)
        finally:
            os.close(fd)

    def check(self, entry: FileEntry) -> None:
        """Read back and verify ``entry`` without writing it anywhere."""
        if entry.blob:
            self.blob(entry)
            return
        for _ in self._frames_once(list(self._plan(self.sized_refs(entry)))):
            pass
