"""Store maintenance: garbage collection (mark and sweep), retention, verification.

GC marks every pack and blob a manifest names, and sweeps the rest — except objects written
since the oldest live lease started (a dump in progress, here or on another node, may be about
to name them). It runs under the store's exclusive lock, so no dump of this daemon is between
"found a page in the index" and "manifest written" while it sweeps.
"""

from __future__ import annotations

from ckptd.core.ports import BlobStore, Clock
from ckptd.core.store.cas import ContentStore
from ckptd.core.store.index import PACK_PREFIX, load_pack_index
from ckptd.core.store.objects import BLOB_PREFIX, LEASE_PREFIX, MANIFEST_PREFIX
from ckptd.domain import GcReport, VerifyReport
from ckptd.errors import CkptdError, CorruptCheckpoint


def collect_garbage(
    store: ContentStore,
    blobs: BlobStore,
    clock: Clock,
    *,
    lease_ttl_s: float = 6 * 3600,
    delete_first: tuple[str, ...] = (),
) -> GcReport:
    for checkpoint_id in delete_first:
        store.delete(checkpoint_id)
    with store.rw.exclusive():
        live_packs: set[str] = set()
        live_blobs: set[str] = set()
        for record in store.list():
            manifest = store.manifest(record.id)
            live_packs.update(manifest.packs)
            live_blobs.update(manifest.blobs)
        now = clock.time()
        lease_starts = []
        for key, mtime in blobs.list(LEASE_PREFIX):
            del key
            if now - mtime < lease_ttl_s:
                lease_starts.append(mtime)
        keep_after = min(lease_starts) - 60.0 if lease_starts else None

        packs_deleted = blobs_deleted = freed = kept = kept_bytes = 0
        gone_packs: set[str] = set()
        for key, mtime in list(blobs.list(PACK_PREFIX)):
            pack_id = key.rsplit("/", 1)[-1]
            size = blobs.size(key)
            if pack_id in live_packs or (keep_after is not None and mtime >= keep_after):
                kept += 1
                kept_bytes += size
                continue
            blobs.delete(key)
            gone_packs.add(pack_id)
            packs_deleted += 1
            freed += size
        for key, mtime in list(blobs.list(BLOB_PREFIX)):
            if key.rsplit("/", 1)[-1] in live_blobs:
                continue
            if keep_after is not None and mtime >= keep_after:
                continue
            freed += blobs.size(key)
            blobs.delete(key)
            blobs_deleted += 1
        blobs.flush()
        store.index.drop_packs(gone_packs)
    return GcReport(
        deleted_checkpoints=delete_first,
        packs_deleted=packs_deleted,
        blobs_deleted=blobs_deleted,
        bytes_freed=freed,
        packs_kept=kept,
        bytes_kept=kept_bytes,
    )


def verify(store: ContentStore, blobs: BlobStore, checkpoint_id: str = "") -> VerifyReport:
    """Read back and check one checkpoint (every page and image against its hash), or the
    whole store: every checkpoint, every manifest, every pack's trailer."""
    problems: list[str] = []
    ids: list[str] = []
    packs_checked = 0
    with store.rw.shared():
        if checkpoint_id:
            ids = [checkpoint_id]
        else:
            ids = [k[len(MANIFEST_PREFIX) :] for k, _ in blobs.list(MANIFEST_PREFIX)]
            for key, _ in blobs.list(PACK_PREFIX):
                packs_checked += 1
                try:
                    load_pack_index(blobs, key.rsplit("/", 1)[-1])
                except CkptdError as exc:
                    problems.append(f"{key}: {exc.message}")
        for cid in ids:
            try:
                manifest = store.manifest(cid, fresh=True)
                reader = store.reader(cid)
                for entry in manifest.files:
                    reader.check(entry)
                for pack_id in manifest.packs:
                    if pack_id not in store.index.packs:
                        problems.append(f"checkpoint {cid}: pack {pack_id} is missing")
            except CorruptCheckpoint as exc:
                problems.append(exc.message if cid in exc.message else f"{cid}: {exc.message}")
            except CkptdError as exc:
                problems.append(f"checkpoint {cid}: {exc.message}")
    return VerifyReport(checked=tuple(ids), problems=tuple(problems), packs_checked=packs_checked)
