"""Where each page lives: page hash -> (pack, frame, index). Rebuilt from pack trailers.

The index is a cache: losing it loses nothing (``refresh`` rebuilds it from the packs the
backend lists). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Container
from dataclasses import dataclass

from ckptd.core.ports import BlobStore
from ckptd.core.store.packs import (
    FOOTER,
    MAGIC,
    PackIndex,
    check_trailer,
    decode_trailer,
    parse_footer,
)
from ckptd.errors import CkptdError, CorruptCheckpoint

PACK_PREFIX = "packs/"


def pack_key(pack_id: str) -> str:
    return f"{PACK_PREFIX}{pack_id[:2]}/{pack_id}"


@dataclass(frozen=True)
class Location:
    pack_id: str
    frame: int
    index: int


def load_pack_index(blobs: BlobStore, pack_id: str) -> PackIndex:
    """Read and check a pack's trailer (two ranged reads)."""
    key = pack_key(pack_id)
    size = blobs.size(key)
    offset, length, checksum = parse_footer(pack_id, blobs.get(key, max(0, size - FOOTER.size)))
    if offset < len(MAGIC) or offset + length > size - FOOTER.size:
        raise CorruptCheckpoint(f"pack {pack_id}: trailer outside the pack (damaged footer)")
    raw = blobs.get(key, offset, offset + length)
    check_trailer(pack_id, raw, checksum)
    return decode_trailer(pack_id, raw)


class _Live:
    def __init__(self, index: PageIndex) -> None:
        self._index = index

    def __contains__(self, page_hash: object) -> bool:
        return isinstance(page_hash, bytes) and self._index.contains(page_hash)


class PageIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[bytes, Location] = {}
        self.packs: dict[str, PackIndex] = {}
        self.damaged: dict[str, str] = {}
        self.condemned: frozenset[str] = frozenset()
        """Packs a GC has condemned: still readable, never deduplicated against."""

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, page_hash: bytes) -> Location | None:
        """Where the page lives: in a pack that is not condemned when one holds it."""
        return self._pages.get(page_hash)

    def contains(self, page_hash: bytes) -> bool:
        """Whether a dump may reference the page instead of storing it: it is in a pack no
        GC has condemned."""
        loc = self._pages.get(page_hash)
        return loc is not None and loc.pack_id not in self.condemned

    def live(self) -> Container[bytes]:
        """The pages a dump may reference (``contains``) as one container for a whole image's
        lookups (``pagepath.plan_new``): the index's own dict when no pack is condemned (a
        lookup in C), else one that asks ``contains``."""
        if not self.condemned:
            return self._pages
        return _Live(self)

    def add_pack(self, pack: PackIndex) -> None:
        with self._lock:
            self.packs[pack.pack_id] = pack
            live = pack.pack_id not in self.condemned
            for h, frame, i in pack.entries():
                old = self._pages.get(h)
                if old is None or (live and old.pack_id in self.condemned):
                    self._pages[h] = Location(pack.pack_id, frame, i)

    def drop_packs(self, pack_ids: set[str]) -> None:
        with self._lock:
            for pid in pack_ids:
                self.packs.pop(pid, None)
            self._rebuild()

    def set_condemned(self, pack_ids: frozenset[str]) -> None:
        """Mark the packs GC has condemned: their pages are located elsewhere when another
        pack holds them, and are never deduplicated against."""
        with self._lock:
            if pack_ids == self.condemned:
                return
            self.condemned = pack_ids
            self._rebuild()

    def _rebuild(self) -> None:
        pages: dict[bytes, Location] = {}
        ordered = sorted(self.packs.values(), key=lambda p: p.pack_id in self.condemned)
        for pack in ordered:
            for h, frame, i in pack.entries():
                pages.setdefault(h, Location(pack.pack_id, frame, i))
        self._pages = pages

    def refresh(self, blobs: BlobStore) -> int:
        """Load the trailers of packs the backend has and the index lacks. Returns how many."""
        listed = {key.rsplit("/", 1)[-1] for key, _ in blobs.list(PACK_PREFIX)}
        new = listed - set(self.packs)
        for pack_id in sorted(new):
            try:
                self.add_pack(load_pack_index(blobs, pack_id))
            except CkptdError as exc:
                self.damaged[pack_id] = exc.message
        gone = set(self.packs) - listed
        if gone:
            self.drop_packs(gone)
        return len(new)
