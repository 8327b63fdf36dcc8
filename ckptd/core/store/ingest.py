"""Ingest: CRIU's image directory -> new packs, blobs and the manifest's file entries.

Pages images are split into 4 KiB pages: zero pages become a flag, pages the store (or this
ingest) already has become references, the rest go into new packs. Every other image is stored
whole as a blob. Nothing here makes anything visible: the caller commits the manifest last.
"""

from __future__ import annotations

import contextlib
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
from ckptd.core.store.packs import Frame, PackBuilder, build_pack_parts
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, PageHasher
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, Compression
from ckptd.core.store.streaming import StreamedPages

BaseLookup = Callable[[str], tuple[str, bytes] | None]
"""For a pages image name: (hash of the full page list to delta against, its references
concatenated)."""


@dataclass
class IngestResult:
    files: list[FileEntry] = field(default_factory=list)
    pages: list[bytes | bytearray] = field(default_factory=list)
    """Each pages image's references, concatenated (16 bytes a page, ZERO_REF for a zero
    page): no object per page (issue #13); ``ContentStore`` finds their packs from them."""
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
    compression: Compression = DEFAULT_COMPRESSION,
    condemned_blobs: frozenset[str] = frozenset(),
    streamed: StreamedPages | None = None,
) -> IngestResult:
    """``executor`` compresses frames; ``writer`` (one thread) writes packs and makes them
    durable while the next pages are hashed. Pages of packs the index has as condemned, and
    ``condemned_blobs``, are stored again (not reused). ``streamed``: the pages images CRIU
    sent instead of writing them (already in packs, ``finish``ed): their page lists are
    stored with the images of the directory."""
    result = IngestResult()
    if streamed is not None:
        _add_streamed(streamed, blobs, hasher, base_for, result, condemned_blobs)
    builder = PackBuilder(executor, compression)
    writes: list[Future[tuple[str, int]]] = []
    fresh: set[bytes] = set()
    with contextlib.ExitStack() as maps:  # pages images stay mapped until their packs are written
        for path in sorted(images.iterdir()):
            if not path.is_file():
                continue
            size = path.stat().st_size
            result.bytes_logical += size
            if is_pages_file(path.name) and size % PAGE_SIZE == 0:
                refs = _split_pages(path, size, hasher, index, builder, fresh, maps)
                result.pages.append(refs)
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
                writes.append(writer.submit(_put_pack, blobs, index, frames))
        builder.finish()
        for frames in builder.take_sealed():
            writes.append(writer.submit(_put_pack, blobs, index, frames))
        for write in writes:
            pack_id, written = write.result()
            result.new_packs.append(pack_id)
            if written:
                result.bytes_new += written
                result.written_packs.add(pack_id)
    result.files.sort(key=lambda f: f.name)
    return result


def _add_streamed(
    streamed: StreamedPages,
    blobs: BlobStore,
    hasher: PageHasher,
    base_for: BaseLookup,
    result: IngestResult,
    condemned_blobs: frozenset[str],
) -> None:
    result.new_packs.extend(streamed.new_packs)
    result.written_packs |= streamed.written_packs
    result.bytes_new += streamed.bytes_new
    for name, refs in streamed.refs.items():
        size = streamed.sizes[name]
        result.bytes_logical += size
        result.pages.append(refs)
        result.files.append(
            _store_page_list(name, size, refs, blobs, hasher, base_for, result, condemned_blobs)
        )


def _put_pack(
    blobs: BlobStore, index: PageIndex, frames: Sequence[tuple[Future[Frame], tuple[bytes, ...]]]
) -> tuple[str, int]:
    """Assemble, write and make durable one pack, then index it: (its id, the bytes written,
    0 when it was there already)."""
    pack_id, parts, pack_index = build_pack_parts(frames)
    # a pack with the same content that GC condemned is written again (a fresh object,
    # protected by this dump's lease), never reused
    again = pack_id in index.condemned
    size = sum(memoryview(p).nbytes for p in parts)
    written = size if blobs.put_parts(pack_key(pack_id), parts, if_absent=not again) else 0
    blobs.flush()
    index.add_pack(pack_index)
    return pack_id, written


def _split_pages(
    path: Path,
    size: int,
    hasher: PageHasher,
    index: PageIndex,
    builder: PackBuilder,
    fresh: set[bytes],
    maps: contextlib.ExitStack,
) -> bytes:
    """References of every page of a pages image, concatenated (``hash_pages``, 16 bytes a
    page); new pages go to ``builder`` in runs of consecutive pages, straight from the
    file's mapping (no copy until compression, none at all for a frame that does not
    compress until its pack is assembled: the mapping stays until ``maps`` closes).

    Two native calls per image (``pagepath``): every page hashed (zero pages found) across
    the CPUs without the GIL, then the runs of pages that are neither zero, in the index nor
    seen earlier in this ingest."""
    if size == 0:
        return b""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    maps.callback(_quietly, mm.close)
    view = memoryview(mm)[:size]
    maps.callback(_quietly, view.release)
    digests = pagepath.hash_pages(view, hasher.seed, zero_ref=True)
    new, runs = pagepath.plan_runs(digests, index.live(), fresh)
    builder.add_runs(new, view, runs, in_runs=True)  # a frame holds pages of one image
    return digests


def _quietly(close: Callable[[], None]) -> None:
    """Release a view or close a mapping, unless a view of it is still in use (an ingest
    that failed with frames in flight): then it goes with its last view."""
    with contextlib.suppress(BufferError):
        close()


def _store_page_list(
    name: str,
    size: int,
    refs: bytes | bytearray,
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
        delta = pagepath.encode_delta(refs, base[1], bytes.fromhex(base[0]))
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
        name=name, size=size, pagelist=list_hash, pagelist_base=base_hash,
        pages=len(refs) // HASH_SIZE,
    )
