"""Pages ingested as CRIU sends them (``adapters.criu.pageserver``), with bounded memory.

A ``PageSink``: each chunk of a pages image is hashed natively at once (``pagepath``); zero pages
become ZERO_REF, known pages references, new pages are copied (the chunk is the receiver's, to
be reused) into ``PackBuilder`` frames. Memory is bounded by waiting: at most ``max_frames``
frames compressing, at most ``max_packs`` packs being written, so CRIU is slowed (its socket
fills) rather than ckptd's memory growing. Held at most, roughly: (max_frames + 1) frames of
4 MiB, plus for each pack being filled or written (1 + max_packs) its frames (up to
2 * pack_bytes of pages; a pack is written from its frames, never joined): with the defaults
36 + 2 * 64 MiB for incompressible pages, less for real ones; plus the receiver's pool
(256 MiB by default).

``refs`` and ``sizes`` then give each pages image's page list, to be stored with the other
(small) images as for a staged dump; nothing is visible before the manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagepath
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.packs import Frame, PackBuilder, build_pack_parts
from ckptd.core.store.pagehash import PageHasher

STREAM_PACK_BYTES = 32 << 20
"""Smaller packs than a staged ingest's: a pack's frames are held until it is sealed and
written, so this sets most of the memory bound."""

Frames = Sequence[tuple[Future[Frame], tuple[bytes, ...]]]


class StreamedPages:
    """The pages of one dump, ingested as they arrive; ``refs``/``sizes`` per pages image."""

    def __init__(
        self,
        *,
        blobs: BlobStore,
        index: PageIndex,
        hasher: PageHasher,
        executor: Executor,
        writer: Executor,
        level: int = 1,
        max_frames: int = 8,
        max_packs: int = 1,
        pack_bytes: int = STREAM_PACK_BYTES,
    ) -> None:
        self._blobs = blobs
        self._index = index
        self._hasher = hasher
        self.seed = hasher.seed
        """The hash space (uid) the pages were hashed in."""
        self._writer = writer
        self._max_frames = max_frames
        self._max_packs = max_packs
        self.builder = PackBuilder(executor, level, pack_bytes)
        self.fresh: set[bytes] = set()
        """New pages of this dump not yet in the index (their pack not written): once a pack
        is indexed its pages are ``known`` and leave this set, so it holds the pages of the
        packs in flight only, not every new page of the dump."""
        self.refs: dict[str, bytearray] = {}
        """Each pages image's references, concatenated (16 bytes a page: no object per
        page; ``pagelist.Refs`` reads them as a sequence)."""
        self.sizes: dict[str, int] = {}
        self.writes: list[Future[Sequence[tuple[bytes, ...]]]] = []
        self.new_packs: list[str] = []
        self.written_packs: set[str] = set()
        self.bytes_new = 0

    # ---- PageSink ----------------------------------------------------------------------------

    def begin_image(self, name: str) -> None:
        self.refs[name] = bytearray()
        self.sizes[name] = 0

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        """Two native calls as for a staged image (``pagepath``: every page hashed, then the
        runs of new pages), then one native copy of only the new pages: ``data`` is the
        receiver's and is reused once this returns."""
        digests = pagepath.hash_pages(data, self.seed, zero_ref=True)
        fresh, runs = pagepath.plan_runs(digests, self._index.live(), self.fresh)
        self.refs[name] += digests
        if runs:
            self.builder.add_run(fresh, memoryview(pagepath.gather_pages(data, runs)))
        self.sizes[name] = offset + len(data)
        self._flow()

    def end_image(self, name: str, size: int) -> None:
        self.sizes[name] = size

    # ---- the end -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Every page compressed and every pack written and durable (one ``flush``)."""
        self.builder.finish()
        self._submit_sealed()
        for write in self.writes:
            write.result()
        self.writes = []
        self.fresh = set()
        self._blobs.flush()  # once, here: not on CRIU's (frozen) path

    # ---- internals ---------------------------------------------------------------------------

    def _flow(self) -> None:
        self.builder.throttle(self._max_frames)
        self._submit_sealed()
        indexed: list[tuple[bytes, ...]] = []
        while len(self.writes) > self._max_packs:
            indexed += self.writes.pop(0).result()
        if indexed:
            for hashes in indexed:
                self.fresh.difference_update(hashes)
            self.fresh = set(self.fresh)  # a set never shrinks its table: a right-sized copy

    def _submit_sealed(self) -> None:
        for frames in self.builder.take_sealed():
            self.writes.append(self._writer.submit(self._put_pack, frames))

    def _put_pack(self, frames: Frames) -> Sequence[tuple[bytes, ...]]:
        """Write and index a pack; its pages' hashes (each frame's), to leave ``fresh``: the
        index has them now, unless the pack is one GC condemned (then none)."""
        pack_id, parts, pack_index = build_pack_parts(frames)
        again = pack_id in self._index.condemned
        if self._blobs.put_parts(pack_key(pack_id), parts, if_absent=not again):
            self.bytes_new += sum(memoryview(p).nbytes for p in parts)
            self.written_packs.add(pack_id)
        self._index.add_pack(pack_index)
        self.new_packs.append(pack_id)
        return () if again else [hashes for _, hashes in frames]
