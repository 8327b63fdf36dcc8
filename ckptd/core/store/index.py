"""Where each page lives: page hash -> (pack, frame, index). Rebuilt from pack trailers.

The index is a cache: losing it loses nothing (``refresh`` rebuilds it from the packs the
backend lists). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagepath
from ckptd.core.store.packs import (
    FOOTER,
    MAGIC,
    PackIndex,
    check_trailer,
    decode_trailer,
    parse_footer,
)
from ckptd.core.store.pagehash import ZERO_REF
from ckptd.errors import CkptdError, CorruptCheckpoint

if TYPE_CHECKING:
    from typing_extensions import Buffer

PACK_PREFIX = "packs/"


def pack_key(pack_id: str) -> str:
    return f"{PACK_PREFIX}{pack_id[:2]}/{pack_id}"


@dataclass(frozen=True)
class Location:
    pack_id: str
    frame: int
    index: int


SLOT_SHIFT = 32
IN_FRAME = (1 << SLOT_SHIFT) - 1
Frames = list[tuple[str, int]]
"""Slot -> (pack id, frame number): decodes a page's code, ``slot << SLOT_SHIFT | index``."""


def load_pack_index(blobs: BlobStore, pack_id: str) -> PackIndex:
    """Read and check a pack's trailer (two ranged reads)."""
    key = pack_key(pack_id)
    size = blobs.size(key)
    offset, length, checksum = parse_footer(pack_id, blobs.get(key, max(0, size - FOOTER.size)))
    if offset < len(MAGIC) or offset + length > size - FOOTER.size:
        raise CorruptCheckpoint(f"pack {pack_id}: trailer outside the pack (damaged footer)")
    raw = blobs.get(key, offset, offset + length)
    check_trailer(pack_id, raw, checksum)
    pack = decode_trailer(pack_id, raw)
    end = len(MAGIC)
    for no, frame in enumerate(pack.frames):
        if frame.offset != end or frame.length <= 0:
            raise CorruptCheckpoint(f"pack {pack_id}: trailer misplaces frame {no} (damaged)")
        end += frame.length
    if end != offset:
        raise CorruptCheckpoint(f"pack {pack_id}: trailer does not account for its frames")
    return pack


def check_pack(blobs: BlobStore, pack_id: str, known: PackIndex | None = None) -> PackIndex:
    """Every structural part of a pack: its magic, its footer (end marker, where the trailer
    is), its trailer (checksum, frames laid end to end from the magic to the trailer) and,
    when the index ``known`` it, that the trailer still says what it did (three ranged reads;
    the frames' pages are verified when read). For ``verify`` and before a restore; start-up
    reads only what the index needs (``load_pack_index``)."""
    key = pack_key(pack_id)
    if blobs.get(key, 0, len(MAGIC)) != MAGIC:
        raise CorruptCheckpoint(f"pack {pack_id}: bad magic (not a pack, or overwritten)")
    pack = load_pack_index(blobs, pack_id)
    if known is not None and pack.frames != known.frames:
        raise CorruptCheckpoint(f"pack {pack_id}: trailer changed since it was indexed")
    return pack


class _Live:
    def __init__(self, index: PageIndex) -> None:
        self._index = index

    def __contains__(self, page_hash: object) -> bool:
        return isinstance(page_hash, bytes) and self._index.contains(page_hash)


class PageIndex:
    """Page hash -> where it lives. A page's location is one int, its *code*: the slot of its
    frame (``Frames``) shifted by SLOT_SHIFT, plus its index in the frame; so a pack's pages
    are indexed in bulk (dict updates from zips, no object per page) and consecutive pages
    of a frame have consecutive codes. Readers take the table and the frames it refers to
    as one snapshot (``_rebuild`` replaces both at once; ``add_pack`` adds the frames
    first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: tuple[dict[bytes, int], Frames] = ({}, [])
        self.packs: dict[str, PackIndex] = {}
        self.damaged: dict[str, str] = {}
        self.condemned: frozenset[str] = frozenset()
        """Packs a GC has condemned: still readable, never deduplicated against."""

    def __len__(self) -> int:
        return len(self._tables[0])

    def get(self, page_hash: bytes) -> Location | None:
        """Where the page lives: in a pack that is not condemned when one holds it."""
        pages, frames = self._tables
        code = pages.get(page_hash)
        if code is None:
            return None
        pack_id, frame = frames[code >> SLOT_SHIFT]
        return Location(pack_id, frame, code & IN_FRAME)

    def contains(self, page_hash: bytes) -> bool:
        """Whether a dump may reference the page instead of storing it: it is in a pack no
        GC has condemned."""
        pages, frames = self._tables
        code = pages.get(page_hash)
        return code is not None and frames[code >> SLOT_SHIFT][0] not in self.condemned

    def live(self) -> Container[bytes]:
        """The pages a dump may reference (``contains``) as one container for a whole image's
        lookups (``pagepath.plan_new``): the index's own dict when no pack is condemned (a
        lookup in C), else one that asks ``contains``."""
        if not self.condemned:
            return self._tables[0]
        return _Live(self)

    def locate(self, refs: Iterable[bytes]) -> tuple[list[int | None], Frames]:
        """The code of every page of ``refs`` (None: not indexed, or ZERO_REF) and the frames
        the codes refer to, from one snapshot: ``frames[code >> SLOT_SHIFT]`` is (pack id,
        frame number), ``code & IN_FRAME`` the index in the frame."""
        pages, frames = self._tables
        return list(map(pages.get, refs)), frames

    def slot_counts(self, refs: Sequence[Buffer]) -> tuple[dict[int, int], Frames]:
        """For the pages of ``refs`` (buffers of concatenated references) that are indexed:
        how many distinct pages each frame slot holds, and the frames the slots refer to, from
        one snapshot (``pagepath.slot_counts``: no object per page)."""
        pages, frames = self._tables
        return pagepath.slot_counts(refs, pages), frames

    def add_pack(self, pack: PackIndex) -> None:
        with self._lock:
            self.packs[pack.pack_id] = pack
            pages, frames = self._tables
            new = _codes(pack, len(frames))
            frames.extend((pack.pack_id, f) for f in range(len(pack.frames)))
            common = new.keys() & pages.keys()
            if common:
                live = pack.pack_id not in self.condemned
                for h in common:  # the new pack wins over a condemned one only
                    if not (live and frames[pages[h] >> SLOT_SHIFT][0] in self.condemned):
                        del new[h]
            pages.update(new)

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
        """Packs not condemned first: a page is located in the first pack (in that order)
        that holds it."""
        ordered = sorted(self.packs.values(), key=lambda p: p.pack_id in self.condemned)
        frames: Frames = []
        bases = []
        for pack in ordered:
            bases.append(len(frames))
            frames.extend((pack.pack_id, f) for f in range(len(pack.frames)))
        pages: dict[bytes, int] = {}
        for pack, base in reversed(list(zip(ordered, bases, strict=True))):
            pages.update(_codes(pack, base))  # earlier packs overwrite later ones
        self._tables = (pages, frames)

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


def _codes(pack: PackIndex, base: int) -> dict[bytes, int]:
    """Hash -> code of every page of ``pack`` whose frames take the slots from ``base``; the
    first occurrence of a hash wins; ZERO_REF is never a location."""
    codes: dict[bytes, int] = {}
    for f_no in reversed(range(len(pack.frames))):
        hashes = pack.frames[f_no].hashes
        slot = (base + f_no) << SLOT_SHIFT
        codes.update(zip(reversed(hashes), reversed(range(slot, slot + len(hashes))), strict=True))
    codes.pop(ZERO_REF, None)
    return codes
