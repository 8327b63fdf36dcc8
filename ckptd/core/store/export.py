"""A committed checkpoint read for another store's hash space: what a migration sends.

Nothing is materialized. ``FrameExport`` reads each frame the checkpoint needs once, verifies
its pages against this store's hashes and hashes them with the target's seed (on the store's
executor, without the GIL): that gives every pages image's references in the target's space,
to be offered. Then, for the pages the target lacks, each frame is read again and sent **as it
is stored** (zstd, or raw pages: no decompression, no recompression) when every one of its
pages is wanted, with the places its pages go; a frame only partly wanted (pages of other
checkpoints, pages the target has) becomes a new frame of just the wanted pages. Other images
go as their stored blobs (zstd), verified first.

Invariants: every reference offered was computed from content verified against this store's
hash; the target verifies every page it receives against the reference offered for its place,
so a frame damaged after the first read (or on the wire) is refused there, never restored.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor

from ckptd.core.ports import BlobStore, ExportedImage, PageFrame, PlaceRun
from ckptd.core.store import pagepath
from ckptd.core.store.index import PageIndex
from ckptd.core.store.manifest import Manifest
from ckptd.core.store.objects import get_blob_stored
from ckptd.core.store.pagehash import HASH_SIZE, ZERO_REF, PageHasher
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, Compression
from ckptd.core.store.reader import CheckpointReader, FrameKey
from ckptd.errors import CorruptCheckpoint, PeerError


class FrameExport(CheckpointReader):
    """``CheckpointExport`` of one committed checkpoint for the hash space ``seed``. Reads on
    construction (``images``); ``frames`` reads again. The caller holds the store's shared
    lock for the export's life (GC must not collect its packs meanwhile)."""

    def __init__(
        self,
        blobs: BlobStore,
        index: PageIndex,
        manifest: Manifest,
        hasher: PageHasher,
        executor: Executor,
        *,
        seed: int,
        compression: Compression = DEFAULT_COMPRESSION,
    ) -> None:
        super().__init__(blobs, index, manifest, hasher, executor)
        self._seed = seed
        self._compression = compression
        self._uses: dict[FrameKey, list[PlaceRun]] = {}
        """Every frame the checkpoint needs, and the places of its pages, in reading order."""
        self._raw: dict[FrameKey, bool] = {}
        self._pages: dict[str, int] = {}
        self.images: Sequence[ExportedImage] = self._read()

    # ---- the offer ------------------------------------------------------------------------

    def _read(self) -> list[ExportedImage]:
        blobs: dict[str, bytes] = {}
        targets: dict[str, bytearray] = {}
        nonzero: dict[str, int] = {}
        for entry in self._m.files:
            if entry.blob:
                packed, data = get_blob_stored(self._blobs, self._hasher, entry.blob, self._id)
                if len(data) != entry.size:
                    raise CorruptCheckpoint(
                        f"checkpoint {self._id}: {entry.name} has {len(data)} bytes, "
                        f"expected {entry.size}", checkpoint_id=self._id,
                    )
                blobs[entry.name] = packed
                continue
            refs = self.sized_refs(entry)
            for key, runs in self._plan(refs).items():
                self._uses.setdefault(key, []).extend(
                    (entry.name, at, idx, count) for at, idx, count in runs
                )
            targets[entry.name] = bytearray(len(refs) * HASH_SIZE)  # all ZERO_REF
            nonzero[entry.name] = len(refs) - refs.count(ZERO_REF)
            self._pages[entry.name] = len(refs)
        for key, theirs in self._each_frame(list(self._uses), self._target_refs):
            for name, at, idx, count in self._uses[key]:
                targets[name][at * HASH_SIZE : (at + count) * HASH_SIZE] = theirs[
                    idx * HASH_SIZE : (idx + count) * HASH_SIZE
                ]
        return [
            ExportedImage(entry.name, entry.size, data=blobs[entry.name])
            if entry.blob
            else ExportedImage(entry.name, entry.size, refs=bytes(targets[entry.name]),
                               pages=nonzero[entry.name])
            for entry in self._m.files
        ]

    def _target_refs(self, key: FrameKey) -> tuple[FrameKey, bytes]:
        """The references of a frame's pages in the target's space (verified here first)."""
        raw, data = self._load_frame_stored(*key)
        self._raw[key] = data is raw
        return key, pagepath.hash_pages(data, self._seed, zero_ref=True)

    # ---- the pages the target lacks -------------------------------------------------------

    def frames(self, wanted: Mapping[str, Sequence[int]]) -> Iterator[PageFrame]:
        masks: dict[str, bytearray] = {}
        for name, indices in wanted.items():
            mask = masks[name] = bytearray(self._pages.get(name, 0))
            for i in indices:
                if not 0 <= i < len(mask):
                    raise PeerError(
                        f"the target asked for page {i} of {name}, which has {len(mask)}",
                        checkpoint_id=self._id,
                    )
                mask[i] = 1
        jobs: dict[FrameKey, tuple[PlaceRun, ...]] = {}
        for key, uses in self._uses.items():
            runs = [run for use in uses for run in _wanted_runs(use, masks.get(use[0]))]
            if runs:
                jobs[key] = tuple(runs)
        yield from self._each_frame(list(jobs), lambda key: self._frame(key, jobs[key]))

    def _frame(self, key: FrameKey, runs: tuple[PlaceRun, ...]) -> PageFrame:
        """The stored frame as it is when ``runs`` cover every page of it; else a new frame
        of the pages they cover (verified as read, then compressed)."""
        pages = len(self._index.packs[key[0]].frames[key[1]].hashes)
        covered = bytearray(pages)
        for _name, _at, src, count in runs:
            covered[src : src + count] = b"\x01" * count
        if covered.count(0) == 0:
            return PageFrame(self._fetch_frame(*key), pages, runs, raw=self._raw[key])
        _raw, data = self._load_frame_stored(*key)
        selected = [i for i, c in enumerate(covered) if c]
        rank = {old: new for new, old in enumerate(selected)}
        spans: list[tuple[int, int]] = []
        for i in selected:
            if spans and sum(spans[-1]) == i:
                spans[-1] = (spans[-1][0], spans[-1][1] + 1)
            else:
                spans.append((i, 1))
        gathered = pagepath.gather_pages(data, spans)
        packed = pagepath.compress_frame(gathered, self._compression)
        return PageFrame(
            bytes(packed), len(selected),
            tuple((name, at, rank[src], count) for name, at, src, count in runs),
            raw=packed is gathered,
        )


def _wanted_runs(use: PlaceRun, mask: bytearray | None) -> Iterator[PlaceRun]:
    """The parts of ``use`` (image, first page there, first page in the frame, count) whose
    places ``mask`` marks."""
    if mask is None:
        return
    name, at, src, count = use
    part = mask[at : at + count]
    marked = part.count(1)
    if marked == count:
        yield use
        return
    if not marked:
        return
    start = -1
    for i, flag in enumerate(part):
        if flag and start < 0:
            start = i
        elif not flag and start >= 0:
            yield name, at + start, src + start, i - start
            start = -1
    if start >= 0:
        yield name, at + start, src + start, count - start
