"""Page identity: a keyed 128-bit hash of 4 KiB of content.

xxh3-128, measured here at 3.3 GB/s per page from Python against 0.9 GB/s for BLAKE3
(docs/adr/0005-page-hash.md). Not collision-resistant against an adversary by itself, so it is
keyed: the seed is derived from the store's secret AND the checkpoint owner's uid. A user can
neither predict hashes nor reach another uid's pages (each uid has its own hash space), so a
crafted collision can at worst corrupt that user's own checkpoints.

This class hashes blobs and single pages; the store hashes and verifies pages in bulk with the
same hash and seed in ``pagepath`` (C, no GIL: docs/adr/0012-native-page-path.md).
"""

from __future__ import annotations

import xxhash

PAGE_SIZE = 4096
HASH_SIZE = 16
ZERO_PAGE = bytes(PAGE_SIZE)
ZERO_REF = bytes(HASH_SIZE)
"""Stands for a page of zeros in page lists: never stored, never hashed."""


class PageHasher:
    """Hashes pages (and blobs) in one uid's hash space of one store."""

    def __init__(self, secret: bytes, uid: int) -> None:
        self.seed = xxhash.xxh3_64_intdigest(secret + uid.to_bytes(8, "little"))
        self.zero = self.digest(ZERO_PAGE)

    @classmethod
    def from_seed(cls, seed: int) -> PageHasher:
        """The hasher of another store's uid hash space (its seed, told by its daemon)."""
        hasher = cls.__new__(cls)
        hasher.seed = seed
        hasher.zero = hasher.digest(ZERO_PAGE)
        return hasher

    def digest(self, data: bytes | memoryview) -> bytes:
        return xxhash.xxh3_128_digest(data, seed=self.seed)

    def page_ref(self, page: bytes | memoryview) -> bytes:
        """The reference a page list stores: ZERO_REF for a zero page, else its hash."""
        h = xxhash.xxh3_128_digest(page, seed=self.seed)
        return ZERO_REF if h == self.zero else h
