"""Where each page lives: page hash -> (pack, frame, index). Rebuilt from pack trailers.

The index is a cache: losing it loses nothing (``refresh`` rebuilds it from the packs the
backend lists). Thread-safe.
"""

from __future__ import annotations

import threading
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


class PageIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[bytes, Location] = {}
        self.packs: dict[str, PackIndex] = {}
        self.damaged: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, page_hash: bytes) -> Location | None:
        return self._pages.get(page_hash)

    def contains(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def add_pack(self, pack: PackIndex) -> None:
        with self._lock:
            self.packs[pack.pack_id] = pack
            for h, frame, i in pack.entries():
                self._pages.setdefault(h, Location(pack.pack_id, frame, i))

    def drop_packs(self, pack_ids: set[str]) -> None:
        with self._lock:
            for pid in pack_ids:
                self.packs.pop(pid, None)
            self._pages = {h: loc for h, loc in self._pages.items() if loc.pack_id not in pack_ids}
            # pages also present in a surviving pack get their other location back
            for pack in self.packs.values():
                for h, frame, i in pack.entries():
                    self._pages.setdefault(h, Location(pack.pack_id, frame, i))

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
