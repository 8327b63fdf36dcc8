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
while that pipeline is full (ingest would have to wait) is appended as it is to the spill
(``Spill``: RAM, an anonymous memfd, up to ``spill_ram`` bytes, then the file
``spill_dir/pages.spill``, sequential writes into the page cache) and so is every later
chunk of the dump, in order; ``finish`` (the commit, after CRIU has let the tree go) ingests
the spilled chunks, in order, exactly as if they had just arrived, then drops the spill. So
the tree stays frozen only for CRIU's own copy, memory stays bounded as above plus the
spill's RAM (at most ``spill_ram``), and the spill (at most the size of its pages) is gone
once the dump is committed or aborted (``discard``); a crash takes the RAM with the daemon
and leaves the file (in the staging of the dump) to the store's ``clean`` at the next start,
with nothing listed. Without ``spill_dir``, ingest waits instead (CRIU is slowed).

``refs`` and ``sizes`` then give each pages image's page list, to be stored with the other
(small) images as for a staged dump; nothing is visible before the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagepath
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.packs import Frame, PackBuilder, build_pack_parts, idle_priority
from ckptd.core.store.pagehash import PAGE_SIZE, PageHasher
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, Compression
from ckptd.errors import StoreError

log = logging.getLogger(__name__)

STREAM_PACK_BYTES = 32 << 20
"""Smaller packs than a staged ingest's: a pack's frames are held until it is sealed and
written, so this sets most of the memory bound."""

Frames = Sequence[tuple[Future[Frame], tuple[bytes, ...]]]

STAGES = ("receiving", "hash", "plan", "copy", "wait", "spill_write", "spill_read", "drain",
          "flush", "finish", "write", "index", "compress_cpu")
"""The stages a streamed dump's profile counts (``StreamedPages.times``): while CRIU sends
(``receiving``, of which hashing, planning, copying new pages, waiting for the pipeline,
writing the spill), after it (``finish``: reading the spill back, draining compression and
pack writes, the flush), pack writes and indexing their pages (on the writer's threads) and
compression (CPU-s)."""

SPILL_NAME = "pages.spill"
SPILL_READ = 4 << 20
"""How much of the spill's file is read back at once (one buffer, reused; the RAM is read in
place)."""


class Spill:
    """Chunks of pages images appended, as they came, to RAM (an anonymous ``memfd``, up to
    ``ram_bytes``) and beyond that to a file in ``directory``; read back in order.

    Invariant: ``entries`` lists every chunk appended, in order, each (image, offset in the
    image, 0 for the memfd or 1 for the file, offset there, length), and the memfd and the
    file hold exactly their chunks' bytes one after the other. The memfd has no name in any
    filesystem (it dies with the daemon: nothing to clean after a crash); the file is
    created exclusively (``O_EXCL``, mode 0600) only once RAM is used up, and removed by
    ``close``, with the directory when this made it. RAM first because the spill is what
    CRIU waits for: written at memory speed it keeps the freeze at CRIU's own copy, where a
    file in a disk's page cache is written at the disk's pace (docs/performance/profile.md).

    The memfd is sized to its budget at once (sparse: RAM is used only as chunks are
    written), sealed against shrinking and growing (so no one, root included, can cut it
    under its mapping: no SIGBUS), and mapped read-only: its chunks are read in place, with
    no copy, and stay valid until ``close`` (frames are compressed straight from them)."""

    def __init__(self, directory: Path, ram_bytes: int = 0) -> None:
        self.directory = directory
        self.path = directory / SPILL_NAME
        self._ram_left = max(0, ram_bytes) // PAGE_SIZE * PAGE_SIZE
        self._map: mmap.mmap | None = None
        self._ram: memoryview | None = None
        self._fds = [-1, -1]
        self._sizes = [0, 0]
        self._made_dir = self._made_file = False
        self._buf: memoryview | None = None
        self.entries: list[tuple[str, int, int, int, int]] = []
        self.size = 0

    @property
    def in_ram(self) -> int:
        """Bytes of the spill held in RAM (the rest is in the file)."""
        return self._sizes[0]

    def _fd_for(self, length: int) -> int:
        """Where a chunk of ``length`` goes: 0 (RAM) while it fits the budget, else 1."""
        if self._fds[1] < 0 and length <= self._ram_left:
            if self._fds[0] < 0:
                self._open_ram()
            self._ram_left -= length
            return 0
        if self._fds[1] < 0:
            self._made_dir = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._fds[1] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                   0o600)
            self._made_file = True
        return 1

    def _open_ram(self) -> None:
        fd = os.memfd_create("ckptd-spill", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self._ram_left)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(fd, self._ram_left, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._ram = memoryview(self._map)
        self._fds[0] = fd

    def append(self, name: str, offset: int, data: memoryview) -> None:
        where = self._fd_for(len(data))
        fd, at, done = self._fds[where], self._sizes[where], 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], at + done)
        self.entries.append((name, offset, where, at, len(data)))
        self._sizes[where] += len(data)
        self.size += len(data)

    def chunks(self, first: int = 0, end: int | None = None
               ) -> Iterator[tuple[str, int, memoryview, bool]]:
        """The chunks of entries ``first`` to ``end`` (default: all), in order, as (image,
        offset in the image, its bytes, stable). Stable: the RAM's, in place, valid until
        ``close``; else the file's, read into one buffer, valid until the next chunk is
        asked for. Entries may be appended meanwhile (``append`` has written an entry's
        bytes before it lists it)."""
        for name, offset, where, at, length in self.entries[first:end]:
            if where == 0 and self._ram is not None:
                yield name, offset, self._ram[at : at + length], True
                continue
            if self._buf is None:
                self._buf = memoryview(bytearray(SPILL_READ))
            view = self._buf
            done = 0
            while done < length:
                take = min(len(view), length - done)
                got = os.preadv(self._fds[where], [view[:take]], at + done)
                if got != take:
                    raise OSError(f"spill file {self.path}: {got} of {take} bytes at "
                                  f"{at + done} read back")
                yield name, offset + done, view[:take], False
                done += take

    def close(self) -> None:
        """Everything dropped. The RAM's mapping goes now unless pages of it are still
        referenced (frames in flight after a failure): then with the last reference."""
        if self._ram is not None:
            self._ram.release()
            self._ram = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        for i, fd in enumerate(self._fds):
            if fd >= 0:
                os.close(fd)
                self._fds[i] = -1
        self.remove()

    def remove(self) -> None:
        """The file (and the directory this made) gone from the staging; what is open stays
        readable until ``close``."""
        if self._made_file:  # never a file of this name it did not make (O_EXCL)
            with contextlib.suppress(OSError):
                self.path.unlink()
        if self._made_dir:
            with contextlib.suppress(OSError):
                self.directory.rmdir()


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
        compression: Compression = DEFAULT_COMPRESSION,
        max_frames: int = 8,
        max_packs: int = 1,
        pack_bytes: int = STREAM_PACK_BYTES,
        spill_dir: Path | None = None,
        spill_ram: int = 0,
    ) -> None:
        self._blobs = blobs
        self._index = index
        self._hasher = hasher
        self.seed = hasher.seed
        """The hash space (uid) the pages were hashed in."""
        self._writer = writer
        self._max_frames = max_frames
        self._max_packs = max_packs
        self.builder = PackBuilder(executor, compression, pack_bytes)
        self._compression_name = str(compression)
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
        self._spill_ram = spill_ram
        self._spill: Spill | None = None
        self.spilled = 0
        """Bytes of pages that went through the spill (its size at its largest)."""
        self.spilled_ram = 0
        """Of which in RAM."""
        self.times: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        """Seconds spent in each stage (``STAGES``), for the dump's profile line."""
        self._times_lock = threading.Lock()
        self._first_chunk = 0.0
        self._drained = 0
        """Spilled entries the drainer has ingested so far."""
        self._spill_cond = threading.Condition()
        self._spill_ended = False
        self._drainer: threading.Thread | None = None
        self._draining = False
        self._drainer_closes = False
        self._abandoned = False
        self._drain_error: BaseException | None = None
        self._after_end = 0
        """Bytes of the spill ingested after the dump ended (the rest overlapped CRIU)."""

    # ---- PageSink ----------------------------------------------------------------------------

    def begin_image(self, name: str) -> None:
        self.refs[name] = bytearray()
        self.sizes[name] = 0

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        """Ingested now if the pipeline has room (``_ingest``), else appended to the spill
        (and from the first spilled chunk on, every chunk): never waits for ingest when
        there is a spill directory. ``data`` is the receiver's and is reused once this
        returns."""
        now = time.perf_counter()
        self._first_chunk = self._first_chunk or now
        if self._spill is None and self._spill_dir is not None and self._behind():
            self._spill = Spill(self._spill_dir, self._spill_ram)
            self._draining = True
            self.builder.idle = True  # while CRIU sends: only CPU time it does not want
            self._drainer = threading.Thread(target=self._drain, args=(self._spill,),
                                             name="spill-drain", daemon=True)
            self._drainer.start()
        if self._spill is not None:
            self._spill.append(name, offset, data)
            with self._spill_cond:
                self._spill_cond.notify()
            self.sizes[name] = max(self.sizes.get(name, 0), offset + len(data))
            self._add("spill_write", now)
        else:
            self._ingest(name, offset, data)
        self.times["receiving"] = time.perf_counter() - self._first_chunk

    def _behind(self) -> bool:
        """Whether ingesting a chunk now could wait: frames or pack writes in flight at
        their bound (a chunk may add a frame and seal a pack)."""
        return (self.builder.compressing() >= self._max_frames
                or sum(not w.done() for w in self.writes) >= self._max_packs)

    def _ingest(self, name: str, offset: int, data: memoryview, *, stable: bool = False
                ) -> None:
        """Two native calls as for a staged image (``pagepath``: every page hashed, then the
        runs of new pages), then one native copy of only the new pages — none when ``data``
        is ``stable`` (the spill's RAM, valid until the packs are written): its frames are
        compressed from it in place, or gathered on the executor."""
        began = time.perf_counter()
        digests = pagepath.hash_pages(data, self.seed, zero_ref=True)
        began = self._add("hash", began)
        fresh, runs = pagepath.plan_runs(digests, self._index.live(), self.fresh)
        self.refs[name] += digests
        began = self._add("plan", began)
        if runs and stable:
            self.builder.add_runs(fresh, data, runs, in_runs=True)
        elif runs:
            self.builder.add_run(fresh, memoryview(pagepath.gather_pages(data, runs)))
        began = self._add("copy", began)
        self.sizes[name] = max(self.sizes.get(name, 0), offset + len(data))
        self._flow()
        self._add("wait", began)

    def end_image(self, name: str, size: int) -> None:
        self.sizes[name] = size

    # ---- the end -----------------------------------------------------------------------------

    def finish(self) -> None:
        """The spilled chunks ingested (in order, after every chunk ingested before them:
        the drainer's, which has ingested what it could while CRIU sent the rest), then
        every page compressed and every pack written and durable (one ``flush``). A spill
        that cannot be read back raises ``StoreError``; the spill is removed either way."""
        spill, self._spill = self._spill, None
        finishing = time.perf_counter()
        if spill is not None:
            self.spilled, self.spilled_ram = spill.size, spill.in_ram
            with self._spill_cond:
                self._spill_ended = True
                self.builder.idle = False  # the tree runs: ingest at full speed now
                self._spill_cond.notify_all()
        try:
            if spill is not None:
                assert self._drainer is not None
                self._drainer.join()
                if isinstance(self._drain_error, OSError):
                    raise StoreError("pages spilled during the dump cannot be read back: "
                                     f"{self._drain_error}") from self._drain_error
                if self._drain_error is not None:
                    raise self._drain_error
                log.info("ingested %d MiB of pages spilled while CRIU dumped (%d MiB after "
                         "the commit began)", spill.size >> 20, self._after_end >> 20)
            began = time.perf_counter()
            self.builder.finish()
            self._submit_sealed()
            for write in self.writes:
                write.result()
            began = self._add("drain", began)
        finally:  # after the writes: frames are read from the spill's RAM in place
            if spill is not None:
                spill.close()
        self.writes = []
        self.fresh = set()
        self._blobs.flush()  # once, here: not on CRIU's (frozen) path
        self._add("flush", began)
        self.times["finish"] = time.perf_counter() - finishing
        self.times["compress_cpu"] = self.builder.compress_cpu_s

    def profile(self) -> str:
        """Where this dump's page ingest spent its time, one line (logged at commit)."""
        t = self.times
        return (f"pages: {t['receiving']:.2f} s receiving from CRIU (hash {t['hash']:.2f}, "
                f"plan {t['plan']:.2f}, copy {t['copy']:.2f}, waiting for compression or "
                f"writes {t['wait']:.2f}, spill {t['spill_write']:.2f} s for "
                f"{self.spilled >> 20} MiB, {self.spilled_ram >> 20} MiB of it in RAM); after "
                f"CRIU {t['finish']:.2f} s (spill read {t['spill_read']:.2f}, draining "
                f"{t['drain']:.2f}, flush {t['flush']:.2f}); "
                f"pack writes {t['write']:.2f} s, indexing {t['index']:.2f} s; compression "
                f"{t['compress_cpu']:.2f} CPU-s "
                f"({self._compression_name}); {self.bytes_new >> 20} MiB new")

    def _add(self, stage: str, began: float) -> float:
        """``stage`` ran from ``began`` until now; now."""
        now = time.perf_counter()
        with self._times_lock:
            self.times[stage] += now - began
        return now


    def discard(self) -> None:
        """The dump is abandoned: its spill (if any) is removed now (the drainer, if it is
        still ingesting, stops at its next chunk and closes it); what was written stays as
        unreferenced packs, for GC."""
        spill, self._spill = self._spill, None
        if spill is None:
            return
        spill.remove()
        with self._spill_cond:
            self._abandoned = self._spill_ended = True
            self._spill_cond.notify_all()
            self._drainer_closes = self._draining
        if not self._drainer_closes:
            spill.close()

    def _drain(self, spill: Spill) -> None:
        """The drainer's thread: ingests the spill's entries in order as they are appended,
        at ingest's own pace (waiting for compression and writes is its wait, never CRIU's),
        until the dump has ended and every entry is in, or the dump is abandoned. Sole
        ingester while the spill exists (the receiver only appends)."""
        try:
            while True:
                with self._spill_cond:
                    while (self._drained >= len(spill.entries) and not self._spill_ended
                           and not self._abandoned):
                        self._spill_cond.wait()
                    if self._abandoned or (self._drained >= len(spill.entries)
                                           and self._spill_ended):
                        return
                    end, ended = len(spill.entries), self._spill_ended
                for i in range(self._drained, end):
                    began = time.perf_counter()
                    for name, offset, data, stable in spill.chunks(i, i + 1):
                        self._add("spill_read", began)
                        with idle_priority(self.builder.idle):
                            self._ingest(name, offset, data, stable=stable)
                        if ended:
                            self._after_end += len(data)
                        began = time.perf_counter()
                    self._drained = i + 1
                    if self._abandoned:
                        return
        except BaseException as exc:  # handed to finish, which raises it
            self._drain_error = exc
        finally:
            with self._spill_cond:
                self._draining = False
                closes = self._drainer_closes
            if closes:
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
        began = time.perf_counter()
        with idle_priority(self.builder.idle):
            written = self._blobs.put_parts(pack_key(pack_id), parts, if_absent=not again)
        began = self._add("write", began)
        if written:
            self.bytes_new += sum(memoryview(p).nbytes for p in parts)
            self.written_packs.add(pack_id)
        self._index.add_pack(pack_index)
        self._add("index", began)
        self.new_packs.append(pack_id)
        return () if again else [hashes for _, hashes in frames]
