"""Frames a migration's target received, kept as they are for the checkpoint's commit.

The receiver verifies every page of a frame against the references offered for its places and
writes it there, in the staged images, before it hands the frame here. A frame whose pages are
all new to this store (none in a live pack, none kept already in this transfer) is kept: a
zstd frame is appended to a spool file beside the staged images (one copy of its compressed
bytes while the job is down); a raw frame is only noted, by the places its pages went to in
the staged images (no copy at all). The commit, in the background after the restore, puts the
kept frames into packs as they are — no recompression — and indexes them before it ingests the
staged images, which then find those pages in the index and store only their page lists.

Keeping is best effort: a frame not kept (a page the store has, a spool that cannot grow) is
stored by that ingest like a page of a local dump, from the staged images. Nothing here is
visible before the commit's manifest; packs written for an aborted commit are unreferenced and
left to GC (the receiver's lease protects them until then). Invariant: a kept frame's bytes
(spooled, or gathered from the staged images) are exactly those whose pages were verified.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.ports import BlobStore, PageFrame
from ckptd.core.store import pagepath
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.packs import TARGET_PACK_BYTES, Frame, SealedPack, build_pack
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF

log = logging.getLogger(__name__)

SPOOL_NAME = "frames.spool"


@dataclass
class KeptPacks:
    packs: list[str] = field(default_factory=list)
    written: set[str] = field(default_factory=set)
    """Packs written (not found there already)."""
    bytes_new: int = 0


Span = tuple[str, int, int]
"""Pages of a staged image: (image, first page, count)."""


@dataclass(frozen=True)
class _Kept:
    hashes: tuple[bytes, ...]
    length: int
    offset: int = -1
    """In the spool (a zstd frame); -1: a raw frame, its pages at ``spans``."""
    spans: tuple[Span, ...] = ()


class KeptFrames:
    """``FrameKeeper`` of one begun checkpoint staged in ``root`` (its images in
    ``root/images``)."""

    def __init__(self, root: Path, index: PageIndex, seed: int) -> None:
        self._path = root / SPOOL_NAME
        self._images = root / "images"
        self._index = index
        self.seed = seed
        """The hash space (uid) the kept pages' hashes are in."""
        self._fd: int | None = os.open(
            self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
        )
        self._end = 0
        self._frames: list[_Kept] = []
        self._seen: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def kept(self) -> int:
        """Frames kept so far."""
        return len(self._frames)

    def keep(self, frame: PageFrame, hashes: Sequence[bytes]) -> bool:
        if not hashes or len(hashes) != frame.pages:
            return False
        if frame.raw != (len(frame.data) == frame.pages * PAGE_SIZE):
            return False  # a zstd frame as long as its pages would read back as raw pages
        unique = set(hashes)
        if len(unique) != len(hashes) or ZERO_REF in unique:
            return False
        live = self._index.live()
        spans = _spans(frame) if frame.raw else ()
        with self._lock:
            if self._fd is None or any(h in live or h in self._seen for h in hashes):
                return False
            if frame.raw:
                kept = _Kept(tuple(hashes), len(frame.data), spans=spans)
            else:
                try:
                    view = memoryview(frame.data)
                    done = 0
                    while done < len(view):
                        done += os.pwrite(self._fd, view[done:], self._end + done)
                except OSError as exc:
                    log.warning("cannot spool received frames at %s (%s): the commit stores "
                                "the rest from the staged images", self._path, exc)
                    self._close()
                    return False
                kept = _Kept(tuple(hashes), len(view), offset=self._end)
                self._end += len(view)
            self._frames.append(kept)
            self._seen |= unique
        return True

    def write_packs(
        self, blobs: BlobStore, index: PageIndex, target_bytes: int = TARGET_PACK_BYTES
    ) -> KeptPacks:
        """Put every kept frame into packs as it is, make them durable (one ``flush``) and
        index them. Call once, from the commit (the staged images as the receiver left
        them); the spool is done with after this."""
        with self._lock:
            self._close()
            frames, self._frames = self._frames, []
        out = KeptPacks()
        if not frames:
            return out
        groups: list[list[_Kept]] = [[]]
        size = 0
        for kept in frames:
            if size >= target_bytes:
                groups.append([])
                size = 0
            groups[-1].append(kept)
            size += kept.length
        indexed = []
        with _Views(self._path, self._images) as views:
            for group in groups:
                pack_id, data, pack_index = _build(views, group)
                again = pack_id in index.condemned  # a fresh object, never a condemned one
                if blobs.put(pack_key(pack_id), data, if_absent=not again):
                    out.written.add(pack_id)
                    out.bytes_new += len(data)
                out.packs.append(pack_id)
                indexed.append(pack_index)
        blobs.flush()
        for pack_index in indexed:  # durable first: a dump may reference them from now on
            index.add_pack(pack_index)
        return out

    def close(self) -> None:
        """Stop keeping (an aborted receive); the spool goes with the staging."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _spans(frame: PageFrame) -> tuple[Span, ...]:
    """Where each page of ``frame`` went (its first place), in frame order, as spans of
    consecutive pages of one image."""
    runs = sorted(frame.runs, key=lambda r: r[2])
    at = 0
    spans: list[Span] = []
    for name, dst, src, count in runs:
        if src != at:  # overlapping places (a page in several): page by page
            return _spans_by_page(frame)
        if spans and spans[-1][0] == name and sum(spans[-1][1:]) == dst:
            spans[-1] = (name, spans[-1][1], spans[-1][2] + count)
        else:
            spans.append((name, dst, count))
        at += count
    return tuple(spans)


def _spans_by_page(frame: PageFrame) -> tuple[Span, ...]:
    place: list[tuple[str, int] | None] = [None] * frame.pages
    for name, dst, src, count in frame.runs:
        for i in range(count):
            if place[src + i] is None:
                place[src + i] = (name, dst + i)
    spans: list[Span] = []
    for p in place:
        assert p is not None  # the receiver keeps only frames whose every page has a place
        name, page = p
        if spans and spans[-1][0] == name and sum(spans[-1][1:]) == page:
            spans[-1] = (name, spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((name, page, 1))
    return tuple(spans)


class _Views(contextlib.ExitStack):
    """Read-only mappings of the spool and the staged images, opened as needed."""

    def __init__(self, spool: Path, images: Path) -> None:
        super().__init__()
        self._spool = spool
        self._images = images
        self._views: dict[str, memoryview] = {}

    def spool(self) -> memoryview:
        return self._view("", self._spool)

    def image(self, name: str) -> memoryview:
        return self._view(name, self._images / name)

    def _view(self, key: str, path: Path) -> memoryview:
        if key not in self._views:
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.callback(mm.close)
            view = memoryview(mm)
            self.callback(view.release)
            self._views[key] = view
        return self._views[key]


def _frame_bytes(views: _Views, kept: _Kept) -> Frame:
    if kept.offset >= 0:
        return views.spool()[kept.offset : kept.offset + kept.length]
    parts: Iterator[bytes] = (
        pagepath.gather_pages(views.image(name), [(first, count)])
        for name, first, count in kept.spans
    )
    return parts.__next__() if len(kept.spans) == 1 else b"".join(parts)


def _build(views: _Views, group: list[_Kept]) -> SealedPack:
    """One pack of kept frames (``build_pack`` copies them out: no view into ``views``
    outlives this call)."""
    parts: list[tuple[Future[Frame], tuple[bytes, ...]]] = []
    for kept in group:
        done: Future[Frame] = Future()
        done.set_result(_frame_bytes(views, kept))
        parts.append((done, kept.hashes))
    return build_pack(parts)
