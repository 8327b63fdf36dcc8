"""Ingest: CRIU's image directory -> new packs, blobs and the manifest's file entries.

Pages images are split into 4 KiB pages: zero pages become a flag, pages the store (or this
ingest) already has become references, the rest go into new packs. Every other image is stored
whole as a blob. Nothing here makes anything visible: the caller commits the manifest last.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagelist, pagepath
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.manifest import FileEntry
from ckptd.core.store.objects import put_blob
from ckptd.core.store.packs import PackBuilder, build_pack
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher

BaseLookup = Callable[[str], tuple[str, Sequence[bytes]] | None]
"""For a pages image name: (hash of the full page list to delta against, its references)."""


@dataclass
class IngestResult:
    files: list[FileEntry] = field(default_factory=list)
    refs: set[bytes] = field(default_factory=set)
    blobs: set[str] = field(default_factory=set)
    bytes_logical: int = 0
    bytes_new: int = 0
    new_packs: list[str] = field(default_factory=list)
    written_packs: set[str] = field(default_factory=set)
    """Packs this ingest wrote (not found already there)."""
    written_blobs: set[str] = field(default_factory=set)
    """Blobs this ingest wrote, also condemned ones it stored again."""


def ingest(
    images: Path,
    *,
    blobs: BlobStore,
    index: PageIndex,
    hasher: PageHasher,
    is_pages_file: Callable[[str], bool],
    base_for: BaseLookup,
    executor: Executor,
    writer: Executor,
    level: int = 1,
    condemned_blobs: frozenset[str] = frozenset(),
) -> IngestResult:
    """``executor`` compresses frames; ``writer`` (one thread) writes packs and makes them
    durable while the next pages are hashed. Pages of packs the index has as condemned, and
    ``condemned_blobs``, are stored again (not reused)."""
    result = IngestResult()
    builder = PackBuilder(executor, level)
    writes: list[Future[None]] = []
    fresh: set[bytes] = set()
    for path in sorted(images.iterdir()):
        if not path.is_file():
            continue
        size = path.stat().st_size
        result.bytes_logical += size
        if is_pages_file(path.name) and size % PAGE_SIZE == 0:
            refs = _split_pages(path, size, hasher, index, builder, fresh)
            result.refs.update(refs)
            result.refs.discard(ZERO_REF)
            entry = _store_page_list(
                path.name, size, refs, blobs, hasher, base_for, result, condemned_blobs
            )
            result.files.append(entry)
        else:
            blob_hash, written = put_blob(
                blobs, hasher, path.read_bytes(), condemned=condemned_blobs
            )
            if written:
                result.written_blobs.add(blob_hash)
            result.blobs.add(blob_hash)
            result.bytes_new += written
            result.files.append(FileEntry(name=path.name, size=size, blob=blob_hash))
        for frames in builder.take_sealed():
            writes.append(writer.submit(_put_pack, blobs, index, frames, result))
    builder.finish()
    for frames in builder.take_sealed():
        writes.append(writer.submit(_put_pack, blobs, index, frames, result))
    for write in writes:
        write.result()
    return result


def _put_pack(
    blobs: BlobStore,
    index: PageIndex,
    frames: Sequence[tuple[Future[bytes], tuple[bytes, ...]]],
    result: IngestResult,
) -> None:
    pack_id, data, pack_index = build_pack(frames)
    # a pack with the same content that GC condemned is written again (a fresh object,
    # protected by this dump's lease), never reused
    again = pack_id in index.condemned
    if blobs.put(pack_key(pack_id), data, if_absent=not again):
        result.bytes_new += len(data)
        result.written_packs.add(pack_id)
    blobs.flush()
    index.add_pack(pack_index)
    result.new_packs.append(pack_id)


def _split_pages(
    path: Path,
    size: int,
    hasher: PageHasher,
    index: PageIndex,
    builder: PackBuilder,
    fresh: set[bytes],
) -> list[bytes]:
    """References of every page of a pages image; new pages go to ``builder`` in runs of
    consecutive pages, straight from the file's mapping (no copy until compression).

    Two native calls per image (``pagepath``): every page hashed (zero pages found) across
    the CPUs without the GIL, then the runs of pages that are neither zero, in the index nor
    seen earlier in this ingest."""
    if size == 0:
        return []
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mm.madvise(mmap.MADV_SEQUENTIAL)
        view = memoryview(mm)[:size]
        try:
            digests = pagepath.hash_pages(view, hasher.seed, zero_ref=True)
            refs, runs = pagepath.plan_new(digests, index.live(), fresh)
            for first, count in runs:
                end = first + count
                builder.add_run(refs[first:end], view[first * PAGE_SIZE : end * PAGE_SIZE])
            builder.drain()  # frames never outlive this mapping
        finally:
            view.release()
    return refs


def _store_page_list(
    name: str,
    size: int,
    refs: list[bytes],
    blobs: BlobStore,
    hasher: PageHasher,
    base_for: BaseLookup,
    result: IngestResult,
    condemned_blobs: frozenset[str],
) -> FileEntry:
    full = pagelist.encode_full(refs)
    encoded, base_hash = full, ""
    base = base_for(name)
    if base is not None and base[0] not in condemned_blobs:
        delta = pagelist.encode_delta(refs, base[1], bytes.fromhex(base[0]))
        if len(delta) * 2 < len(full):
            encoded, base_hash = delta, base[0]
    list_hash, written = put_blob(blobs, hasher, encoded, condemned=condemned_blobs)
    result.bytes_new += written
    if written:
        result.written_blobs.add(list_hash)
    result.blobs.add(list_hash)
    if base_hash:
        result.blobs.add(base_hash)
    return FileEntry(
        name=name, size=size, pagelist=list_hash, pagelist_base=base_hash, pages=len(refs)
    )
