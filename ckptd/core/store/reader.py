"""Reading a checkpoint back: every byte verified against its hash on the way out.

Each frame a file needs is fetched, decompressed (unless stored raw), verified and its runs of
consecutive pages written (``pwrite``, into a sparse file: zero pages are never written)
exactly once, a few frames in flight on an executor; all of it without the GIL (zstd,
``pagepath``). A streamed restore reads a file in order instead (``stream``): the same frames,
verified the same way, yielded as slices in the file's order, a few frames held at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor, Future, wait
from pathlib import Path
from typing import TypeVar

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagelist, pagepath
from ckptd.core.store.index import (
    IN_FRAME,
    SLOT_SHIFT,
    Frames,
    PageIndex,
    check_pack,
    pack_key,
)
from ckptd.core.store.manifest import FileEntry, Manifest
from ckptd.core.store.objects import get_blob
from ckptd.core.store.packs import read_frame_data
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.errors import BlobNotFound, CkptdError, CorruptCheckpoint

PREFETCH = 6
STREAM_SEGMENTS_AHEAD = 4096
"""A streamed image's runs queued ahead at most (their frames: at most PREFETCH)."""
ZEROS = memoryview(bytes(1 << 20))
"""What a streamed image's zero pages are read from (1 MiB at a time)."""

FrameKey = tuple[str, int]
Segment = tuple[int, FrameKey, int, int]
"""A run of a streamed image: (page in the image, frame, first page in the frame, count)."""
T = TypeVar("T")


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
        """Each frame is loaded, verified and its runs written (one native call) on the
        executor, a bounded number in flight."""
        for _ in self._each_frame(list(runs), lambda key: self._write_frame(fd, key, runs[key])):
            pass

    def _write_frame(self, fd: int, key: FrameKey, runs: list[tuple[int, int, int]]) -> None:
        pagepath.write_runs(fd, self._load_frame(*key), runs)

    def _plan(self, refs: Sequence[bytes]) -> dict[FrameKey, list[tuple[int, int, int]]]:
        """For each frame ``refs`` need: (page in the file, index in the frame, count) of
        every run of consecutive pages it supplies. Zero pages need no frame. One native
        call finds the runs (``pagepath.code_runs``); a page in no pack refreshes the index
        once (packs another daemon wrote), then is an error."""
        codes, frames = self._index.locate(refs)
        found, missing = pagepath.code_runs(codes, refs)
        if missing or self._elsewhere(found, frames):
            self._index.refresh(self._blobs)
            codes, frames = self._index.locate(refs)
            found, missing = pagepath.code_runs(codes, refs)
        if missing:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page {refs[missing[0]].hex()} is in no pack "
                f"({self._lost_packs()})",
                checkpoint_id=self._id,
            )
        runs: dict[FrameKey, list[tuple[int, int, int]]] = {}
        for at, code, count in found:
            runs.setdefault(frames[code >> SLOT_SHIFT], []).append((at, code & IN_FRAME, count))
        return runs

    def _elsewhere(self, found: Sequence[tuple[int, int, int]], frames: Frames) -> bool:
        """Whether a page is located in a pack the checkpoint does not name: its manifest
        was rewritten by a compaction (on another node, maybe), and that pack may be gone
        once the grace period passed; the index is then refreshed (located anew)."""
        if not self._packs:
            return False
        named = set(self._packs)
        return any(frames[code >> SLOT_SHIFT][0] not in named for _at, code, _n in found)

    def _segments(self, refs: Sequence[bytes]) -> list[Segment]:
        """``_plan``'s runs in the image's order (zero pages are the gaps between them)."""
        return sorted(
            (at, key, first, count)
            for key, runs in self._plan(refs).items()
            for at, first, count in runs
        )

    def stream_refs(self, refs: Sequence[bytes]) -> Iterator[memoryview]:
        """The pages ``refs`` in order (``stream_segments`` of their plan)."""
        return self.stream_segments(self._segments(refs), len(refs))

    def stream_segments(
        self, segments: Sequence[Segment], pages: int, window: Callable[[], int] | None = None
    ) -> Iterator[memoryview]:
        """The ``pages`` pages that ``segments`` (``_segments``) place, in order, zero pages
        (the gaps) as zeros: each frame fetched, verified
        (decompressed unless raw) on the executor, a few ahead of need, and yielded (slices
        of it) only once verified. Bounded: at most ``window()`` (default PREFETCH, at least
        1) frames are loaded or held at a time, plus the one being yielded (a frame the image
        comes back to later is loaded again). Raises
        CorruptCheckpoint (naming the checkpoint and the object) at the first frame that
        fails, having yielded only the verified pages before it. When this ends, early or
        not, no frame load of it runs any more."""
        ahead: deque[tuple[Segment, Future[bytes]]] = deque()
        loaded: dict[FrameKey, tuple[Future[bytes], int]] = {}  # future, segments queued
        page = 0
        nxt = 0
        try:
            while nxt < len(segments) or ahead:
                while nxt < len(segments) and len(ahead) < STREAM_SEGMENTS_AHEAD:
                    seg = segments[nxt]
                    key = seg[1]
                    held = loaded.get(key)
                    if held is None:
                        if loaded and len(loaded) >= (window() if window else PREFETCH):
                            break
                        held = (self._executor.submit(self._load_frame, *key), 0)
                    loaded[key] = (held[0], held[1] + 1)
                    ahead.append((seg, held[0]))
                    nxt += 1
                (at, key, first, count), future = ahead.popleft()
                data = future.result()
                future_, queued = loaded[key]
                if queued == 1:
                    del loaded[key]
                else:
                    loaded[key] = (future_, queued - 1)
                yield from _zeros((at - page) * PAGE_SIZE)
                yield memoryview(data)[first * PAGE_SIZE : (first + count) * PAGE_SIZE]
                page = at + count
            yield from _zeros((pages - page) * PAGE_SIZE)
        finally:
            pending = [f for f, _ in loaded.values()]
            for future in pending:
                future.cancel()
            wait(pending)

    def _each_frame(self, keys: list[FrameKey], work: Callable[[FrameKey], T]) -> Iterator[T]:
        """``work`` of each frame of ``keys``, in order, run on the executor with a bounded
        number in flight. When this ends, early or not, no ``work`` runs any more (it may
        write to a descriptor the caller closes next)."""
        ahead: deque[Future[T]] = deque()
        try:
            for key in keys:
                ahead.append(self._executor.submit(work, key))
                if len(ahead) >= PREFETCH:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()
            wait(ahead)

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
        return self._load_frame_stored(pack_id, frame_no)[1]

    def load_frame(self, pack_id: str, frame_no: int) -> bytes:
        """One frame's pages, every one verified (CorruptCheckpoint otherwise)."""
        return self._load_frame(pack_id, frame_no)

    def _fetch_frame(self, pack_id: str, frame_no: int) -> bytes:
        """A frame's bytes as its pack stores them (zstd, or raw pages), unverified."""
        frame = self._index.packs[pack_id].frames[frame_no]
        try:
            return self._blobs.get(pack_key(pack_id), frame.offset, frame.offset + frame.length)
        except BlobNotFound as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: pack {pack_id} is missing", checkpoint_id=self._id
            ) from exc

    def _load_frame_stored(self, pack_id: str, frame_no: int) -> tuple[bytes, bytes]:
        """A frame as stored, and its pages, every one verified against its hash (the same
        object when the frame is stored raw)."""
        raw = self._fetch_frame(pack_id, frame_no)
        hashes = self._index.packs[pack_id].frames[frame_no].hashes
        try:
            return raw, read_frame_data(pack_id, frame_no, raw, hashes, self._hasher)
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

    def pack_problems(self, skip: Collection[str] = ()) -> dict[str, str]:
        """Pack id -> what is wrong with its structure (``index.check_pack``: magic, footer,
        trailer), for every pack the checkpoint names but those in ``skip``; read in
        parallel on the executor. Empty: all intact."""
        packs = [p for p in self._m.packs if p not in skip]

        def problem(pack_id: str) -> str:
            try:
                check_pack(self._blobs, pack_id, self._index.packs.get(pack_id))
            except BlobNotFound:
                return f"pack {pack_id} is missing"
            except CkptdError as exc:
                return exc.message
            return ""

        found = zip(packs, self._executor.map(problem, packs), strict=True)
        return {pack_id: what for pack_id, what in found if what}

    def check_packs(self) -> None:
        """Raise ``CorruptCheckpoint`` naming the checkpoint and the first damaged pack if
        any pack it names is structurally damaged (before a restore writes anything)."""
        for what in self.pack_problems().values():
            raise CorruptCheckpoint(f"checkpoint {self._id}: {what}", checkpoint_id=self._id)

    def refs(self, entry: FileEntry) -> list[bytes]:
        data = self._list(entry)
        base = self._base(entry, pagelist.decode)
        with self._damaged_list(entry):
            return pagelist.decode(data, base, pages=entry.pages or None)

    def packed_refs(self, entry: FileEntry) -> pagelist.Refs:
        """``refs`` held packed (16 bytes a page, an object only per item read)."""
        data = self._list(entry)
        base = self._base(entry, pagelist.decode_full_packed)
        with self._damaged_list(entry):
            return pagelist.Refs(pagelist.decode_packed(data, base, pages=entry.pages or None))

    def _list(self, entry: FileEntry) -> bytes:
        return get_blob(self._blobs, self._hasher, entry.pagelist, self._id)

    def _base(self, entry: FileEntry, decode: Callable[[bytes], T]) -> T | None:
        """The decoded base of ``entry``'s page list if it is a delta."""
        if not entry.pagelist_base:
            return None
        return decode(get_blob(self._blobs, self._hasher, entry.pagelist_base, self._id))

    @contextlib.contextmanager
    def _damaged_list(self, entry: FileEntry) -> Iterator[None]:
        """A damaged page list named with the checkpoint and the image."""
        try:
            yield
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page list of {entry.name} is damaged ({exc.message})",
                checkpoint_id=self._id,
            ) from exc

    def frame_runs(self, refs: Sequence[bytes]
                   ) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
        """For each frame ``refs`` need: (page in ``refs``, index in the frame, count) of
        each run it supplies; zero pages need none (CorruptCheckpoint: a page in no pack)."""
        return self._plan(refs)

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

    def stream_plan(self, entry: FileEntry) -> tuple[list[Segment], int]:
        """What ``stream`` of the pages image ``entry`` needs: its runs in order and its
        number of pages (its page list read and every page located; CorruptCheckpoint if
        one is in no pack)."""
        return self._segments(self.sized_refs(entry)), entry.size // PAGE_SIZE

    def stream(self, entry: FileEntry, plan: tuple[list[Segment], int] | None = None,
               window: Callable[[], int] | None = None) -> Iterator[memoryview]:
        """``entry``'s file in order, every byte verified before it is yielded (see
        ``stream_segments``; an image stored whole is verified whole first). ``plan``:
        ``stream_plan(entry)``, made beforehand."""
        if entry.blob:
            yield memoryview(self.blob(entry))
            return
        yield from self.stream_segments(*(plan or self.stream_plan(entry)), window)

    def check(self, entry: FileEntry) -> None:
        """Read back and verify ``entry`` without writing it anywhere."""
        if entry.blob:
            self.blob(entry)
            return
        keys = list(self._plan(self.sized_refs(entry)))
        for _ in self._each_frame(keys, lambda key: self._load_frame(*key)):
            pass


def _zeros(size: int) -> Iterator[memoryview]:
    """``size`` bytes of zeros, in chunks of ZEROS."""
    while size > 0:
        chunk = ZEROS[: min(size, len(ZEROS))]
        size -= len(chunk)
        yield chunk
