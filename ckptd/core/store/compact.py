"""Compaction: rewrite packs that are mostly garbage, so that GC can free them
(docs/adr/0018-store-compaction.md).

A pack is freed only when no manifest names it; a pack in which one live page remains is
pinned whole. Pages are referenced by content (a page list holds hashes; the index locates a
hash in whichever pack holds it), and a manifest names its packs only so that GC keeps them
and a restore checks them first. So compaction never changes a page list: it copies the live
pages of the packs whose live share is below ``below`` (by stored bytes) into new packs, makes
them durable, then rewrites — atomically, one object each, signed again — the manifests that
named those packs so that they name the packs their pages are now located in. The old packs
are then unreferenced: the mark/condemn/sweep that follows (``maintenance``) frees them like
any garbage, after the grace period.

Crash safety, at every point: the new packs are durable before any manifest names them; a
manifest names either its old packs (still there: nothing is deleted here) or its new ones
(flushed before); a crash leaves at worst new packs nothing names (garbage for the next GC)
and this node's compaction lease (removed at the next start, ``ContentStore.clean``). The
next compaction finds those live pages twice (old packs, new packs): each is counted live in
the one pack the index locates it in, so the other copies are rewritten away as well.

Concurrency: the caller holds the store's exclusive lock (no dump or restore of this node
runs). Other nodes: the compaction's lease keeps every node's GC from collecting the new packs
before the manifests name them; the old packs are only condemned, so another node's restore
or dump that located a page in one keeps reading it for the grace period, and a reader whose
index still locates a page in a pack its manifest no longer names refreshes its index
(``reader.PageSource._plan``). Only packs whose pages all belong to one uid's hash space, named
by authenticated manifests only, not condemned and not written since the oldest live lease
started, are rewritten.
"""

from __future__ import annotations

import builtins
import contextlib
import json
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Protocol

from ckptd.core.ports import BlobStore, Clock
from ckptd.core.store.index import IN_FRAME, PACK_PREFIX, SLOT_SHIFT, PageIndex, pack_key
from ckptd.core.store.manifest import Manifest
from ckptd.core.store.objects import LEASE_PREFIX
from ckptd.core.store.packs import Frame, PackBuilder, build_pack_parts, read_frame_data
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.core.store.pagepath import Compression
from ckptd.core.store.reader import CheckpointReader
from ckptd.errors import BlobNotFound, CkptdError

COMPACT_BELOW = 2 / 3
"""A pack whose live pages hold less than this share of its stored bytes is rewritten: every
pack left holds at least 2/3 live bytes, so the packs take at most 1.5x the live data."""

COMPACT_LEASE_PREFIX = f"{LEASE_PREFIX}compact-"
LOAD_AHEAD = 4
"""Frames read and verified ahead of the one being copied (each at most 4 MiB, twice)."""


def compact_lease_key(node: str) -> str:
    """This node's compaction lease (one compaction at a time per node: GC is exclusive)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node) or "local"
    return f"{COMPACT_LEASE_PREFIX}{safe}"


class CompactedStore(Protocol):
    """What compaction needs of the content store (``cas.ContentStore`` is one)."""

    @property
    def index(self) -> PageIndex: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def compression(self) -> Compression: ...

    @property
    def node(self) -> str: ...

    def hasher(self, uid: int) -> PageHasher: ...

    def manifest(self, checkpoint_id: str, *, fresh: bool = False) -> Manifest: ...

    def reader(self, checkpoint_id: str) -> CheckpointReader: ...

    def rewrite_manifest(self, manifest: Manifest) -> bool: ...


@dataclass(frozen=True)
class Compaction:
    packs_rewritten: int = 0
    """Old packs whose live pages were copied (now unreferenced: GC condemns them)."""
    bytes_rewritten: int = 0
    """Their stored size."""
    packs_written: int = 0
    bytes_written: int = 0
    manifests_rewritten: int = 0


@dataclass
class _Pack:
    size: int
    live: float = 0.0
    uids: set[int] | None = None
    frames: dict[int, list[int]] | None = None
    """Frame number -> indices of its live pages located here."""


def compact(
    store: CompactedStore,
    blobs: BlobStore,
    clock: Clock,
    *,
    listed: Iterable[str],
    pinned_elsewhere: set[str],
    keep_after: float | None,
    below: float = COMPACT_BELOW,
) -> Compaction:
    """Rewrite the packs whose live share is below ``below`` (see the module docstring).
    ``listed``: the checkpoints whose manifests authenticate; ``pinned_elsewhere``: packs
    named by manifests this node cannot read (never rewritten); ``keep_after``: packs written
    since then may be named by a dump in progress (never rewritten)."""
    index = store.index
    manifests: dict[str, Manifest] = {}
    refs: dict[str, list[bytes]] = {}  # per checkpoint: each pages image's refs, joined
    unsafe: set[str] = set(pinned_elsewhere)  # packs never rewritten
    live: dict[int, set[bytes]] = defaultdict(set)
    for cid in listed:
        try:
            manifest = store.manifest(cid, fresh=True)
            reader = store.reader(cid)
            lists = [reader.refs(f) for f in manifest.files if f.pagelist]
        except CkptdError:  # damaged or gone: whatever it names stays as it is
            with contextlib.suppress(CkptdError):
                unsafe.update(store.manifest(cid).packs)
            continue
        manifests[cid] = manifest
        refs[cid] = [b"".join(r) for r in lists]
        for r in lists:
            live[manifest.uid].update(r)
    named = {p for m in manifests.values() for p in m.packs}
    # a page is counted live in a pack a manifest names, never in a copy no manifest names
    # (the old packs of an interrupted compaction, a dump's packs not yet committed)
    index.set_condemned(index.condemned | (frozenset(index.packs) - named - unsafe))
    sizes: dict[str, int] = {}
    for key, mtime in blobs.list(PACK_PREFIX):
        pack_id = key.rsplit("/", 1)[-1]
        if pack_id in named and (keep_after is None or mtime < keep_after):
            sizes[pack_id] = blobs.size(key)
    packs = {p: _Pack(size) for p, size in sizes.items()}
    for uid, hashes in live.items():
        hashes.discard(ZERO_REF)
        codes, frames = index.locate(hashes)
        if any(c is None for c in codes):  # a page in no pack: rewrite nothing of this uid
            unsafe.update(p for m in manifests.values() if m.uid == uid for p in m.packs)
        per_slot: dict[int, list[int]] = defaultdict(list)
        for code in codes:
            if code is not None:
                per_slot[code >> SLOT_SHIFT].append(code & IN_FRAME)
        for slot, at in per_slot.items():
            pack_id, frame_no = frames[slot]
            pack = packs.get(pack_id)
            if pack is None:
                continue
            frame = index.packs[pack_id].frames[frame_no]
            pack.live += frame.length * len(at) / len(frame.hashes)
            pack.uids = (pack.uids or set()) | {uid}
            pack.frames = pack.frames or {}
            pack.frames[frame_no] = sorted(at)
    victims = {
        p: pack for p, pack in packs.items()
        if p not in unsafe and p not in index.condemned and p in index.packs
        and len(pack.uids or ()) <= 1 and pack.live < below * pack.size
    }
    if not victims:
        return Compaction()

    lease = compact_lease_key(store.node)
    blobs.put(lease, json.dumps({"node": store.node, "started": clock.time(),
                                 "compaction": True}).encode())
    try:
        written, written_bytes, copied, new = _copy_live(store, blobs, victims)
        blobs.flush()
        # locate pages anew: in the new packs (one may be a copy an interrupted compaction
        # left, no manifest names it yet), not in the old ones
        index.set_condemned((index.condemned - new) | frozenset(copied))
        rewritten = 0
        for cid, manifest in manifests.items():
            if not copied.intersection(manifest.packs):
                continue
            counts, frames = index.slot_counts(refs[cid])
            now_in = {frames[slot][0] for slot in counts}
            if now_in & copied:
                continue  # a page still located in an old pack: leave this manifest be
            if store.rewrite_manifest(replace(manifest, packs=tuple(sorted(now_in)))):
                rewritten += 1
        blobs.flush()
    finally:
        blobs.delete(lease)
        blobs.flush()
    return Compaction(
        packs_rewritten=len(copied),
        bytes_rewritten=sum(victims[p].size for p in copied),
        packs_written=written,
        bytes_written=written_bytes,
        manifests_rewritten=rewritten,
    )


def _copy_live(
    store: CompactedStore, blobs: BlobStore, victims: dict[str, _Pack]
) -> tuple[int, int, set[str], set[str]]:
    """Copy the live pages of ``victims`` into new packs (one uid's pages per pack), each
    frame verified as it is read (read, decompressed and verified on the executor, a few
    ahead: without the GIL); a frame wholly live is kept as it is, others are gathered and
    compressed again. Returns (packs written, their bytes, the victims copied whole, the new
    packs' ids)."""
    index = store.index
    by_uid: dict[int, list[str]] = defaultdict(list)
    for pack_id, pack in sorted(victims.items()):
        by_uid[next(iter(pack.uids)) if pack.uids else -1].append(pack_id)
    written = written_bytes = 0
    failed: set[str] = set()
    new: set[str] = set()

    def load(pack_id: str, frame_no: int, hasher: PageHasher) -> tuple[bytes, bytes]:
        info = index.packs[pack_id].frames[frame_no]
        raw = blobs.get(pack_key(pack_id), info.offset, info.offset + info.length)
        return raw, read_frame_data(pack_id, frame_no, raw, info.hashes, hasher)

    for uid, pack_ids in by_uid.items():
        if uid < 0:  # no live page is located in these (a page is located in one pack only:
            continue  # copies an interrupted compaction left): nothing to copy, all dead
        builder = PackBuilder(store.executor, store.compression)
        hasher = store.hasher(uid)
        todo = [(p, f, at) for p in pack_ids for f, at in sorted((victims[p].frames or {}).items())]
        ahead: deque[Future[tuple[bytes, bytes]]] = deque()
        for i, (pack_id, frame_no, at) in enumerate(todo):
            while len(ahead) < LOAD_AHEAD and i + len(ahead) < len(todo):
                p, f, _ = todo[i + len(ahead)]
                ahead.append(store.executor.submit(load, p, f, hasher))
            future = ahead.popleft()
            try:
                raw, data = future.result()
            except (CkptdError, BlobNotFound):
                failed.add(pack_id)  # damaged or gone: it stays named (its pages located there)
                continue
            hashes = index.packs[pack_id].frames[frame_no].hashes
            if len(at) == len(hashes):
                builder.add_frame(raw, hashes)  # wholly live: as it is
            else:
                view = memoryview(data)
                for first, count in _runs(at):
                    builder.add_run(list(hashes[first : first + count]),
                                    view[first * PAGE_SIZE : (first + count) * PAGE_SIZE])
            builder.throttle(8)
            for group in builder.take_sealed():
                new_id, n = _put_pack(blobs, index, group)
                new.add(new_id)
                written, written_bytes = written + 1, written_bytes + n
        builder.finish()
        for group in builder.take_sealed():
            new_id, n = _put_pack(blobs, index, group)
            new.add(new_id)
            written, written_bytes = written + 1, written_bytes + n
    # a pack written again with a victim's content (the pages of an earlier compaction that
    # was interrupted, located in older copies) is their new home, not garbage
    return written, written_bytes, set(victims) - failed - new, new


FrameGroup = builtins.list[tuple[Future[Frame], tuple[bytes, ...]]]


def _put_pack(blobs: BlobStore, index: PageIndex, group: FrameGroup) -> tuple[str, int]:
    pack_id, parts, pack_index = build_pack_parts(group)
    size = sum(memoryview(p).nbytes for p in parts)
    # always written (a fresh object the compaction's lease protects), even if one with the
    # same content exists: it may be condemned
    blobs.put_parts(pack_key(pack_id), parts)
    index.add_pack(pack_index)
    return pack_id, size


def _runs(indices: builtins.list[int]) -> Iterator[tuple[int, int]]:
    """(first, count) of each run of consecutive values of sorted ``indices``."""
    first = prev = indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            yield first, prev - first + 1
            first = i
        prev = i
    yield first, prev - first + 1
