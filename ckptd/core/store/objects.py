"""Keys and encodings of the store's objects other than packs."""

from __future__ import annotations

from collections.abc import Container

import zstandard

from ckptd.core.ports import BlobStore
from ckptd.core.store.pagehash import PageHasher
from ckptd.errors import BlobNotFound, CorruptCheckpoint

MANIFEST_PREFIX = "manifests/"
GROUP_PREFIX = "groups/"
BLOB_PREFIX = "blobs/"
LEASE_PREFIX = "leases/"
CONFIG_KEY = "store.json"


def blob_key(blob_hash: str) -> str:
    return f"{BLOB_PREFIX}{blob_hash[:2]}/{blob_hash}"


def manifest_key(checkpoint_id: str) -> str:
    return f"{MANIFEST_PREFIX}{checkpoint_id}"


def lease_key(checkpoint_id: str) -> str:
    return f"{LEASE_PREFIX}{checkpoint_id}"


def put_blob(
    blobs: BlobStore,
    hasher: PageHasher,
    data: bytes,
    level: int = 3,
    *,
    condemned: Container[str] = (),
) -> tuple[str, int]:
    """Store ``data`` compressed under its hash (once; again when GC ``condemned`` it, so the
    object is fresh). Returns (hash, bytes written: 0 when it was already there)."""
    blob_hash = hasher.digest(data).hex()
    key = blob_key(blob_hash)
    again = blob_hash in condemned
    if not again and blobs.exists(key):
        return blob_hash, 0
    packed = zstandard.ZstdCompressor(level=level).compress(data)
    return blob_hash, len(packed) if blobs.put(key, packed, if_absent=not again) else 0


def get_blob(blobs: BlobStore, hasher: PageHasher, blob_hash: str, checkpoint_id: str) -> bytes:
    """A blob's content, verified against its hash."""
    return get_blob_stored(blobs, hasher, blob_hash, checkpoint_id)[1]


def get_blob_stored(
    blobs: BlobStore, hasher: PageHasher, blob_hash: str, checkpoint_id: str
) -> tuple[bytes, bytes]:
    """A blob as stored (a zstd frame) and its content, verified against its hash."""
    key = blob_key(blob_hash)
    try:
        packed = blobs.get(key)
    except BlobNotFound as exc:
        raise CorruptCheckpoint(
            f"checkpoint {checkpoint_id}: object {key} is missing", checkpoint_id=checkpoint_id
        ) from exc
    try:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        data = dobj.decompress(packed)
        if not dobj.eof:
            raise zstandard.ZstdError("truncated frame")
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(
            f"checkpoint {checkpoint_id}: object {key} does not decompress",
            checkpoint_id=checkpoint_id,
        ) from exc
    if hasher.digest(data).hex() != blob_hash:
        raise CorruptCheckpoint(
            f"checkpoint {checkpoint_id}: object {key} does not match its hash",
            checkpoint_id=checkpoint_id,
        )
    return packed, data
