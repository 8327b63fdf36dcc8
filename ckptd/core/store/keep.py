"""Frames a migration's target received, kept as they are for the checkpoint's commit.

The receiver verifies every page of a frame against the references offered for its places
before it hands the frame here. A frame whose pages are all new to this store (none in a live
pack, none kept already in this transfer) is appended to a spool file beside the staged images:
one copy while the job is down. The commit, in the background after the restore, puts the
spooled frames into packs as they are — no recompression — and indexes them before it ingests
the staged images, which then find those pages in the index and store only their page lists.

Keeping is best effort: a frame not kept (a page the store has, a spool that cannot grow) is
stored by that ingest like a page of a local dump, from the staged images. Nothing here is
visible before the commit's manifest; packs written for an aborted commit are unreferenced and
left to GC (the receiver's lease protects them until then).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.ports import BlobStore, PageFrame
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


class KeptFrames:
    """``FrameKeeper`` of one begun checkpoint: frames spooled in ``root`` (its staging)."""

    def __init__(self, root: Path, index: PageIndex, seed: int) -> None:
        self._path = root / SPOOL_NAME
        self._index = index
        self.seed = seed
        """The hash space (uid) the kept pages' hashes are in."""
        self._fd: int | None = os.open(
            self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
        )
        self._end = 0
        self._frames: list[tuple[int, int, tuple[bytes, ...]]] = []
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
        with self._lock:
            if self._fd is None or any(h in live or h in self._seen for h in hashes):
                return False
            try:
                view = memoryview(frame.data)
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], self._end + done)
            except OSError as exc:
                log.warning("cannot spool received frames at %s (%s): the commit stores the "
                            "rest from the staged images", self._path, exc)
                self._close()
                return False
            self._frames.append((self._end, len(view), tuple(hashes)))
            self._end += len(view)
            self._seen |= unique
        return True

    def write_packs(
        self, blobs: BlobStore, index: PageIndex, target_bytes: int = TARGET_PACK_BYTES
    ) -> KeptPacks:
        """Put every kept frame into packs as it is, make them durable (one ``flush``) and
        index them. Call once, from the commit; the spool is done with after this."""
        with self._lock:
            self._close()
            frames, self._frames = self._frames, []
        out = KeptPacks()
        if not frames:
            return out
        with open(self._path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            spool = memoryview(mm)
            try:
                groups: list[list[tuple[int, int, tuple[bytes, ...]]]] = [[]]
                size = 0
                for kept in frames:
                    if size >= target_bytes:
                        groups.append([])
                        size = 0
                    groups[-1].append(kept)
                    size += kept[1]
                indexed = []
                for group in groups:
                    pack_id, data, pack_index = _build(spool, group)
                    again = pack_id in index.condemned  # a fresh object, never a condemned one
                    if blobs.put(pack_key(pack_id), data, if_absent=not again):
                        out.written.add(pack_id)
                        out.bytes_new += len(data)
                    out.packs.append(pack_id)
                    indexed.append(pack_index)
                blobs.flush()
                for pack_index in indexed:  # durable first: a dump may reference them now
                    index.add_pack(pack_index)
            finally:
                spool.release()
        return out

    def close(self) -> None:
        """Stop keeping (an aborted receive); the spool goes with the staging."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _build(spool: memoryview, group: list[tuple[int, int, tuple[bytes, ...]]]) -> SealedPack:
    """One pack of spooled frames (``build_pack`` copies them out: no view of ``spool``
    outlives this call)."""
    parts: list[tuple[Future[Frame], tuple[bytes, ...]]] = []
    for offset, length, hashes in group:
        done: Future[Frame] = Future()
        done.set_result(spool[offset : offset + length])
        parts.append((done, hashes))
    return build_pack(parts)
