"""Pages ingested as CRIU sends them (``adapters.criu.pageserver``), with bounded memory.

A ``PageSink``: each chunk of a pages image is hashed natively at once (``pagepath``); zero pages
become ZERO_REF, known pages references, new pages are copied (the chunk is the receiver's, to
be reused) into ``PackBuilder`` frames. Memory is bounded: at most ``max_frames`` frames
compressing, at most ``max_packs`` packs being written. Held at most, roughly: (max_frames + 1)
frames of 4 MiB, plus for each pack being filled or written (1 + max_packs) its frames (up to
2 * pack_bytes of pages; a pack is written from its frames, never joined): with the defaults
36 + 2 * 64 MiB for incompressible pages, less for real ones; plus the receiver's pool
(256 MiB by default).

**CRIU never waits for ingest** (with ``spill_dir``; docs/adr/0021): a chunk that arrives
while that pipeline is full (ingest would have to wait) is appended as it is to a spill file
(``spill_dir/pages.spill``, sequential writes into the page cache) and so is every later
chunk of the dump, in order; ``finish`` (the commit, after CRIU has let the tree go) ingests
the spilled chunks, in order, exactly as if they had just arrived, then removes the file. So
the tree stays frozen only for CRIU's own copy, memory stays bounded as above, and the spill
(on disk, the staging of the dump, at most the size of its pages) is gone once the dump is
committed or aborted (``discard``); a crash leaves it to the store's ``clean`` at the next
start, with nothing listed. Without ``spill_dir``, ingest waits instead (CRIU is slowed).

``refs`` and ``sizes`` then give each pages image's page list, to be stored with the other
(small) images as for a staged dump; nothing is visible before the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagepath
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.packs import Frame, PackBuilder, build_pack_parts
from ckptd.core.store.pagehash import PageHasher
from ckptd.errors import StoreError

log = logging.getLogger(__name__)

STREAM_PACK_BYTES = 32 << 20
"""Smaller packs than a staged ingest's: a pack's frames are held until it is sealed and
written, so this sets most of the memory bound."""

Frames = Sequence[tuple[Future[Frame], tuple[bytes, ...]]]

SPILL_NAME = "pages.spill"
SPILL_READ = 4 << 20
"""How much of the spill is read back at once (one buffer, reused)."""


class Spill:
    """Chunks of pages images appended, as they came, to one file; read back in order.

    Invariant: ``entries`` lists every chunk appended, in order, each (image, offset in the
    image, offset in the file, length), and the file holds exactly their bytes one after the
    other. The file is created exclusively (``O_EXCL``, mode 0600) and removed by ``close``;
    the directory too when this made it."""

    def __init__(self, directory: Path) -> None:
        self._made_dir = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = directory / SPILL_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.entries: list[tuple[str, int, int, int]] = []
        self.size = 0

    def append(self, name: str, offset: int, data: memoryview) -> None:
        at, done = self.size, 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], at + done)
        self.entries.append((name, offset, at, len(data)))
        self.size += len(data)

    def chunks(self) -> Iterator[tuple[str, int, memoryview]]:
        """Every chunk appended, in order, as (image, offset in the image, its bytes): the
        bytes are one buffer, valid until the next chunk is asked for."""
        buf = bytearray(min(SPILL_READ, max((n for *_, n in self.entries), default=0)))
        view = memoryview(buf)
        for name, offset, at, length in self.entries:
            done = 0
            while done < length:
                take = min(len(view), length - done)
                got = os.preadv(self._fd, [view[:take]], at + done)
                if got != take:
                    raise OSError(f"spill file {self.path}: {got} of {take} bytes at "
                                  f"{at + done} read back")
                yield name, offset + done, view[:take]
                done += take

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self._made_dir:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


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
        spill_dir: Path | None = None,
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
        self._spill_dir = spill_dir
        self._spill: Spill | None = None
        self.spilled = 0
        """Bytes of pages that went through the spill file (its size at its largest)."""

    # ---- PageSink ----------------------------------------------------------------------------

    def begin_image(self, name: str) -> None:
        self.refs[name] = bytearray()
        self.sizes[name] = 0

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        """Ingested now if the pipeline has room (``_ingest``), else appended to the spill
        (and from the first spilled chunk on, every chunk): never waits for ingest when
        there is a spill directory. ``data`` is the receiver's and is reused once this
        returns."""
        if self._spill is None and self._spill_dir is not None and self._behind():
            self._spill = Spill(self._spill_dir)
        if self._spill is not None:
            self._spill.append(name, offset, data)
            self.sizes[name] = offset + len(data)
            return
        self._ingest(name, offset, data)

    def _behind(self) -> bool:
        """Whether ingesting a chunk now could wait: frames or pack writes in flight at
        their bound (a chunk may add a frame and seal a pack)."""
        return (self.builder.compressing() >= self._max_frames
                or sum(not w.done() for w in self.writes) >= self._max_packs)

    def _ingest(self, name: str, offset: int, data: memoryview) -> None:
        """Two native calls as for a staged image (``pagepath``: every page hashed, then the
        runs of new pages), then one native copy of only the new pages."""
        digests = pagepath.hash_pages(data, self.seed, zero_ref=True)
        fresh, runs = pagepath.plan_runs(digests, self._index.live(), self.fresh)
        self.refs[name] += digests
        if runs:
            self.builder.add_run(fresh, memoryview(pagepath.gather_pages(data, runs)))
        self.sizes[name] = max(self.sizes.get(name, 0), offset + len(data))
        self._flow()

    def end_image(self, name: str, size: int) -> None:
        self.sizes[name] = size

    # ---- the end -----------------------------------------------------------------------------

    def finish(self) -> None:
        """The spilled chunks ingested (in order, after every chunk ingested before them),
        then every page compressed and every pack written and durable (one ``flush``).
        A spill that cannot be read back raises ``StoreError``; the spill is removed either
        way."""
        spill, self._spill = self._spill, None
        if spill is not None:
            self.spilled = spill.size
            try:
                for name, offset, data in spill.chunks():
                    self._ingest(name, offset, data)
            except OSError as exc:
                raise StoreError(f"pages spilled during the dump cannot be read back: {exc}"
                                 ) from exc
            finally:
                spill.close()
            log.info("ingested %d MiB of pages spilled while CRIU dumped", spill.size >> 20)
        self.builder.finish()
        self._submit_sealed()
        for write in self.writes:
            write.result()
        self.writes = []
        self.fresh = set()
        self._blobs.flush()  # once, here: not on CRIU's (frozen) path


    def discard(self) -> None:
        """The dump is abandoned: its spill (if any) is removed; what was written stays as
        unreferenced packs, for GC."""
        spill, self._spill = self._spill, None
        if spill is not None:
            spill.close()

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
