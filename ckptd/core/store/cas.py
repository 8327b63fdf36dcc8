"""ContentStore: the ``CheckpointStore`` port over a ``BlobStore``, content-addressed.

Dump: ``begin`` gives CRIU a staging directory (RAM-backed when it fits) and writes a lease;
``commit`` ingests it (new pages into packs, metadata images into blobs), makes every object
durable (``flush``), then writes the manifest — the only thing that makes a checkpoint visible
— and drops the staging and the lease. Restore: ``checkout`` rebuilds CRIU's image directory,
verifying every byte; ``checkout_streamed`` gives the images to read as CRIU asks for them
(verified as they pass) instead. GC and the dumps/restores of this daemon exclude each other
(``RWLock``);
leases keep a crashed or foreign dump's fresh objects from being collected, and GC condemns
objects a grace period before deleting them (``maintenance``): a dump never reuses a condemned
object, and re-checks before its manifest that nothing it names has become due.

Invariants: a manifest is written only after everything it names is durable; a checkpoint is
listed iff its manifest exists and is intact; nothing a live manifest names is ever deleted.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ckptd.core.ports import BlobStore, Clock, ImageSource, PageSink
from ckptd.core.store import maintenance, pagelist, pagepath
from ckptd.core.store.compact import COMPACT_BELOW, compact_lease_key
from ckptd.core.store.condemned import Condemned, load_condemned
from ckptd.core.store.export import FrameExport
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.ingest import IngestResult, ingest
from ckptd.core.store.integrity import (
    Adoption,
    ManifestCensus,
    StartupCheck,
    adopt_unauthenticated,
    manifest_census,
    startup_check,
)
from ckptd.core.store.keep import KeptFrames, KeptPacks
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import Manifest
from ckptd.core.store.objects import (
    CONFIG_KEY,
    GROUP_PREFIX,
    MANIFEST_PREFIX,
    blob_key,
    get_blob,
    lease_key,
    manifest_key,
)
from ckptd.core.store.pagehash import ZERO_REF, PageHasher
from ckptd.core.store.pagepath import DEFAULT_COMPRESSION, Compression
from ckptd.core.store.reader import CheckpointReader, PageSource
from ckptd.core.store.restream import CheckpointImages
from ckptd.core.store.rwlock import RWLock
from ckptd.core.store.streaming import StreamedPages
from ckptd.domain import CheckpointRecord, GcReport, GroupRecord, VerifyReport
from ckptd.domain.model import is_checkpoint_id
from ckptd.errors import BlobNotFound, CheckpointNotFound, CorruptCheckpoint, StoreError

log = logging.getLogger(__name__)

STREAM_STAGING_HINT = 256 << 20
"""The staging a streamed dump asks for: its non-page images (and captured files)."""


def _check_id(checkpoint_id: str) -> None:
    """Staging directories and leases are named by the id: never anything but an id."""
    if not is_checkpoint_id(checkpoint_id):
        raise StoreError(f"invalid checkpoint id {checkpoint_id[:80]!r}")


@dataclass(frozen=True)
class StagingPolicy:
    """Where CRIU writes images before ingest: ``fast`` (RAM-backed) when the dump fits there
    with ``headroom`` to spare, else ``disk``."""

    fast: Path | None
    disk: Path
    headroom: int = 1 << 30

    def choose(self, size_hint: int) -> Path:
        if self.fast is not None and size_hint > 0:
            with contextlib.suppress(OSError):
                st = _statvfs(self.fast)
                if st >= size_hint * 5 // 4 + self.headroom:
                    return self.fast
        return self.disk


def _statvfs(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _empty(root: Path) -> list[str]:
    """Remove what is in ``root``, fd-relative: a link planted as ``root`` or in it is never
    followed (removed itself, as an entry), nothing outside ``root`` is touched. The paths
    removed."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []  # missing (or a link: never followed)
    removed = []
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=fd, ignore_errors=True)
                else:
                    os.unlink(name, dir_fd=fd)
                removed.append(str(root / name))
    finally:
        os.close(fd)
    return removed


def _remove_soon(path: Path) -> None:
    """Remove a staging or checkout directory on a background thread (removing a 1 GiB
    tmpfs tree takes ~0.1 s nobody needs to wait for). A crash before it ran leaves the
    directory to ``clean`` at the next start."""
    threading.Thread(
        target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
        name="rmtree", daemon=True,
    ).start()


class ContentStore:
    def __init__(
        self,
        blobs: BlobStore,
        staging: StagingPolicy,
        *,
        clock: Clock,
        is_pages_file: Callable[[str], bool],
        keys: ManifestKeys,
        node: str = "",
        workers: int = 2,
        compression: Compression = DEFAULT_COMPRESSION,
        gc_grace_s: float = 6 * 3600.0,
        stream_pages: bool = False,
        spill_ram: Callable[[], int] = lambda: 0,
    ) -> None:
        """``spill_ram``: how many bytes of a streamed dump's spill may be held in RAM
        (asked at each dump; 0: all of it in the staging's file)."""
        self._blobs = blobs
        self.location = blobs.location
        self._staging = staging
        self._clock = clock
        self._is_pages_file = is_pages_file
        self._node = node
        self._compression = compression
        self.gc_grace_s = gc_grace_s
        self._condemned = Condemned()
        pagepath.warn_if_slow()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zstd")
        # two: one assembles a pack (a native copy, no GIL) while the other writes one
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="packs")
        self._secret = self._load_secret()
        self._keys = keys
        self._hashers: dict[int, PageHasher] = {}
        self._manifests: dict[str, Manifest] = {}
        self._listed_mtimes: dict[str, float] = {}
        self._staged: dict[str, Path] = {}
        self._stream_pages = stream_pages
        self._spill_ram = spill_ram
        self._streams: dict[str, StreamedPages] = {}
        self._spill_roots: dict[str, Path] = {}
        self._kept: dict[str, KeptFrames] = {}
        self._mutex = threading.Lock()
        self.rw = RWLock()
        self.index = PageIndex()
        self.index.refresh(blobs)
        self.refresh_condemned()

    # ---- set-up -----------------------------------------------------------------------------

    def _load_secret(self) -> bytes:
        try:
            return bytes.fromhex(json.loads(self._blobs.get(CONFIG_KEY))["secret"])
        except BlobNotFound:
            pass
        config = json.dumps({"format": 1, "secret": secrets.token_hex(32)}).encode()
        self._blobs.put(CONFIG_KEY, config, if_absent=True)
        self._blobs.flush()
        return bytes.fromhex(json.loads(self._blobs.get(CONFIG_KEY))["secret"])

    def refresh_condemned(self) -> Condemned:
        """Read the condemned lists again (GC on any node may have written them)."""
        condemned = load_condemned(self._blobs)
        with self._mutex:
            self._condemned = condemned
        self.index.set_condemned(frozenset(condemned.packs))
        return condemned

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Compresses and verifies frames (``workers`` threads)."""
        return self._executor

    @property
    def compression(self) -> Compression:
        """How new page frames are compressed (frames of every codec are read)."""
        return self._compression

    @property
    def node(self) -> str:
        return self._node

    def hasher(self, uid: int) -> PageHasher:
        with self._mutex:
            if uid not in self._hashers:
                self._hashers[uid] = PageHasher(self._secret, uid)
            return self._hashers[uid]

    # ---- dump -------------------------------------------------------------------------------

    def begin(self, checkpoint_id: str, size_hint: int = 0, *, ghost_bytes: int = 0) -> Path:
        _check_id(checkpoint_id)
        spill = self._staging.choose(size_hint)  # where pages CRIU sends too fast may go
        if self._stream_pages:  # the staging holds only what is not pages
            size_hint = min(size_hint, STREAM_STAGING_HINT)
        # ghost files are not pages: staged whole, streamed or not (issue 33)
        root = self._staging.choose(size_hint + ghost_bytes) / checkpoint_id
        images = root / "images"
        try:
            images.mkdir(parents=True, mode=0o700)
        except OSError as exc:
            raise StoreError(
                f"cannot create staging directory {images}: {exc}", checkpoint_id=checkpoint_id
            ) from exc
        lease = {"node": self._node, "started": self._clock.time(), "checkpoint": checkpoint_id}
        self._blobs.put(lease_key(checkpoint_id), json.dumps(lease).encode())
        with self._mutex:
            self._staged[checkpoint_id] = root
            self._spill_roots[checkpoint_id] = spill
        return images

    def page_sink(self, checkpoint_id: str, uid: int) -> PageSink | None:
        """With ``stream_pages``: a sink putting the pages of the begun ``checkpoint_id``
        into packs as CRIU sends them (``StreamedPages``); ``commit`` stores the rest."""
        if not self._stream_pages:
            return None
        self._staging_root(checkpoint_id)  # begun here
        # pages arriving faster than they are ingested spill to the staging a whole dump of
        # the tree's size would get (RAM only when all of it fits there with the policy's
        # headroom, else the disk), so CRIU never waits for ingest; they are ingested at the
        # commit, after the tree is let go (docs/adr/0021)
        with self._mutex:
            spill = self._spill_roots.get(checkpoint_id, self._staging.disk)
        sink = StreamedPages(blobs=self._blobs, index=self.index, hasher=self.hasher(uid),
                             executor=self._executor, writer=self._writer,
                             compression=self._compression, spill_dir=spill / checkpoint_id,
                             spill_ram=self._spill_ram())
        with self._mutex:
            self._streams[checkpoint_id] = sink
        return sink

    def frame_keeper(self, checkpoint_id: str, uid: int) -> KeptFrames | None:
        """Frames a migration's receiver verified, kept as they are for this begun
        checkpoint's commit (``keep``): its pages are not compressed again."""
        root = self._staging_root(checkpoint_id)
        try:
            keeper = KeptFrames(root, self.index, self.hasher(uid).seed)
        except OSError:
            return None  # the commit compresses them from the staged images
        with self._mutex:
            old = self._kept.pop(checkpoint_id, None)
            self._kept[checkpoint_id] = keeper
        if old is not None:
            old.close()
        return keeper

    def commit(self, record: CheckpointRecord) -> CheckpointRecord:
        root = self._staging_root(record.id)
        hasher = self.hasher(record.uid)
        with self._mutex:
            streamed = self._streams.get(record.id)
            kept = self._kept.pop(record.id, None)
        if streamed is not None and streamed.seed != hasher.seed:
            raise StoreError(f"checkpoint {record.id}: pages streamed for another uid than "
                             f"uid {record.uid}", checkpoint_id=record.id)
        with self.rw.shared():
            condemned = self.refresh_condemned()
            if streamed is not None:
                streamed.finish()
                log.info("checkpoint %s: %s", record.id, streamed.profile())
            kept_packs = KeptPacks()
            if kept is not None:  # received frames, verified in this uid's space: as they are
                if kept.seed == hasher.seed:
                    kept_packs = kept.write_packs(self._blobs, self.index)
                kept.close()
            result, packs, stored = self._ingest(record, root / "images", hasher, streamed,
                                                 kept_packs, condemned)
            self._blobs.flush()
            record, manifest = self._write_manifest(record, result, packs, stored, kept_packs)
            self._blobs.flush()
        with self._mutex:
            self._manifests[record.id] = manifest
        with self._mutex:
            self._staged.pop(record.id, None)
            self._streams.pop(record.id, None)
            self._spill_roots.pop(record.id, None)
        _remove_soon(root)
        self._blobs.delete(lease_key(record.id))
        return record

    def _ingest(
        self, record: CheckpointRecord, images: Path, hasher: PageHasher,
        streamed: StreamedPages | None, kept_packs: KeptPacks, condemned: Condemned,
    ) -> tuple[IngestResult, list[str], int]:
        """The staged images into packs and blobs (pages already stored reused); again, up
        to three times, while another node's GC removed or condemned what they reuse (a
        streamed dump cannot be redone: refused). The result, its packs and its footprint."""
        for attempt in range(3):
            if streamed is not None and attempt:  # its pages were not kept: cannot redo
                raise StoreError(
                    f"packs vanished or were condemned during the dump of {record.id}",
                    checkpoint_id=record.id, hint="dump again",
                )
            result = ingest(
                images,
                blobs=self._blobs,
                index=self.index,
                hasher=hasher,
                is_pages_file=self._is_pages_file,
                base_for=self._bases_from(record.parent_id, record.uid),
                executor=self._executor,
                writer=self._writer,
                compression=self._compression,
                condemned_blobs=frozenset(condemned.blobs),
                streamed=streamed,
            )
            result.written_packs |= kept_packs.written
            packs, stored = self._packs_and_footprint(result.pages, result.blobs)
            gone = {p for p in packs if not self._blobs.exists(pack_key(p))}
            # another node's GC may have condemned what this dump reuses since it began:
            # what is due now (and was not just stored again) is stored again
            condemned = self.refresh_condemned()
            now = self._clock.time()
            due = (condemned.due_packs(now) & set(packs)) - result.written_packs
            due_blobs = (condemned.due_blobs(now) & result.blobs) - result.written_blobs
            if not gone and not due and not due_blobs:
                break
            self.index.drop_packs(gone)  # another node's GC: store those pages again
        else:
            raise StoreError(
                f"packs vanished or were condemned during commit of {record.id}",
                checkpoint_id=record.id,
            )
        return result, packs, stored

    def _write_manifest(
        self, record: CheckpointRecord, result: IngestResult, packs: list[str], stored: int,
        kept_packs: KeptPacks,
    ) -> tuple[CheckpointRecord, Manifest]:
        """The signed manifest written, if absent (the checkpoint becomes visible): the
        record with its sizes (the manifest's own bytes counted as new)."""
        record = replace(
            record,
            bytes=stored,
            bytes_logical=result.bytes_logical,
            bytes_new=result.bytes_new + kept_packs.bytes_new,
            duration_s=self._clock.time() - record.created,  # until durable
        )
        manifest = Manifest(
            record=record,
            uid=record.uid,
            files=tuple(result.files),
            packs=tuple(packs),
            blobs=tuple(sorted(result.blobs)),
        )
        data = manifest.to_bytes(self._keys, self.store_id)
        record = replace(record, bytes_new=record.bytes_new + len(data))
        manifest = replace(manifest, record=record)
        data = manifest.to_bytes(self._keys, self.store_id)
        if not self._blobs.put(manifest_key(record.id), data, if_absent=True):
            raise StoreError(f"checkpoint {record.id} exists already", checkpoint_id=record.id)
        return record, manifest

    def _packs_and_footprint(
        self, pages: Sequence[bytes | bytearray], blobs: set[str]
    ) -> tuple[builtins.list[str], int]:
        """The packs the pages of ``pages`` (each image's references, concatenated) live in,
        and the bytes the checkpoint occupies if it were alone: its distinct pages' share of
        their compressed frames, plus its blobs."""
        per_slot, frames = self.index.slot_counts(pages)
        packs: set[str] = set()
        total = 0.0
        for slot, count in per_slot.items():
            pack_id, frame_no = frames[slot]
            packs.add(pack_id)
            frame = self.index.packs[pack_id].frames[frame_no]
            total += frame.length * count / len(frame.hashes)
        for b in blobs:
            with contextlib.suppress(BlobNotFound):
                total += self._blobs.size(blob_key(b))
        return sorted(packs), int(total)

    def _bases_from(
        self, parent_id: str, uid: int
    ) -> Callable[[str], tuple[str, bytes] | None]:
        parent: Manifest | None = None
        if parent_id:
            with contextlib.suppress(CheckpointNotFound, CorruptCheckpoint):
                parent = self.manifest(parent_id)
        if parent is None or parent.uid != uid:
            return lambda _name: None
        entries = {f.name: f for f in parent.files if f.pagelist}
        hasher = self.hasher(uid)

        def base_for(name: str) -> tuple[str, bytes] | None:
            entry = entries.get(name)
            if entry is None:
                return None
            full = entry.pagelist_base or entry.pagelist
            try:
                data = get_blob(self._blobs, hasher, full, parent_id)
                return full, pagelist.decode_full_packed(data)  # 16 B/page (issue #13)
            except CorruptCheckpoint:
                return None

        return base_for

    def _staging_root(self, checkpoint_id: str) -> Path:
        with self._mutex:
            root = self._staged.get(checkpoint_id)
        if root is None:
            raise StoreError(
                f"checkpoint {checkpoint_id} was not begun here", checkpoint_id=checkpoint_id
            )
        return root

    def abort(self, checkpoint_id: str) -> None:
        """Drop a dump's staging and lease. Never touches a committed checkpoint."""
        _check_id(checkpoint_id)
        with self._mutex:
            root = self._staged.pop(checkpoint_id, None)
            streamed = self._streams.pop(checkpoint_id, None)  # its packs: unreferenced, for GC
            kept = self._kept.pop(checkpoint_id, None)
            spill_root = self._spill_roots.pop(checkpoint_id, self._staging.disk)
        if streamed is not None:
            streamed.discard()
        if kept is not None:
            kept.close()
        roots = [root] if root else [p / checkpoint_id for p in self._staging_roots()]
        spill = spill_root / checkpoint_id  # a spill's directory (``streaming``)
        for r in [*roots, spill] if spill not in roots else roots:
            shutil.rmtree(r, ignore_errors=True)
        self._blobs.delete(lease_key(checkpoint_id))

    def _staging_roots(self) -> list[Path]:
        return [p for p in (self._staging.fast, self._staging.disk) if p is not None]

    # ---- reading ---------------------------------------------------------------------------

    def manifest(self, checkpoint_id: str, *, fresh: bool = False) -> Manifest:
        """The checkpoint's manifest; ``fresh`` reads (and checks) it again from the backend."""
        with self._mutex:
            cached = None if fresh else self._manifests.get(checkpoint_id)
        if cached is not None:
            return cached
        if not is_checkpoint_id(checkpoint_id):
            raise CheckpointNotFound(
                f"{checkpoint_id!r} is not a checkpoint id", checkpoint_id=checkpoint_id
            )
        try:
            data = self._blobs.get(manifest_key(checkpoint_id))
        except BlobNotFound as exc:
            raise CheckpointNotFound(
                f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id
            ) from exc
        try:
            manifest = Manifest.from_bytes(data, checkpoint_id, self._keys, self.store_id)
        except CorruptCheckpoint:
            with self._mutex:  # never serve a copy of what is now known to be damaged
                self._manifests.pop(checkpoint_id, None)
            raise
        with self._mutex:
            self._manifests[checkpoint_id] = manifest
        return manifest

    def list(self) -> builtins.list[CheckpointRecord]:
        records = []
        live = set()
        for key, mtime in self._blobs.list(MANIFEST_PREFIX):
            cid = key[len(MANIFEST_PREFIX) :]
            live.add(cid)
            # A manifest changed on disk since it was cached (damaged, replaced) is read and
            # checked again: listed iff intact, also for a daemon that has it cached.
            with self._mutex:
                fresh = self._listed_mtimes.get(cid) != mtime
            with contextlib.suppress(CorruptCheckpoint, CheckpointNotFound):
                records.append(self.manifest(cid, fresh=fresh).record)
                with self._mutex:
                    self._listed_mtimes[cid] = mtime
        with self._mutex:
            for gone in set(self._manifests) - live:
                del self._manifests[gone]
            for gone in set(self._listed_mtimes) - live:
                del self._listed_mtimes[gone]
        return sorted(records, key=lambda r: (r.created, r.id))

    def get(self, checkpoint_id: str) -> CheckpointRecord:
        return self.manifest(checkpoint_id).record

    def delete(self, checkpoint_id: str) -> None:
        with contextlib.suppress(CorruptCheckpoint):
            self.manifest(checkpoint_id, fresh=True)
        self._blobs.delete(manifest_key(checkpoint_id))
        self._blobs.flush()
        with self._mutex:
            self._manifests.pop(checkpoint_id, None)

    def rewrite_manifest(self, manifest: Manifest) -> bool:
        """Replace a checkpoint's manifest, signed again, by ``manifest`` (compaction: the
        same record and files, other packs). One atomic put; False (nothing written) when
        the checkpoint is gone. Call under the exclusive lock, every pack it names durable.
        A delete of the checkpoint on another node between the check and the put brings it
        back (whole and restorable: the packs it names exist), never half of it."""
        key = manifest_key(manifest.record.id)
        if not self._blobs.exists(key):
            return False
        self._blobs.put(key, manifest.to_bytes(self._keys, self.store_id))
        with self._mutex:
            self._manifests[manifest.record.id] = manifest
            self._listed_mtimes.pop(manifest.record.id, None)
        return True

    def reader(self, checkpoint_id: str) -> CheckpointReader:
        manifest = self.manifest(checkpoint_id, fresh=True)
        if any(p not in self.index.packs for p in manifest.packs):
            self.index.refresh(self._blobs)  # packs written (or collected) by another node
        return CheckpointReader(
            self._blobs, self.index, manifest, self.hasher(manifest.uid), self._executor
        )

    @contextlib.contextmanager
    def checkout(self, checkpoint_id: str) -> Iterator[Path]:
        manifest = self.manifest(checkpoint_id, fresh=True)
        with self._restore_dir(checkpoint_id, sum(f.size for f in manifest.files)) as images:
            with self.rw.shared():
                reader = self.reader(checkpoint_id)
                reader.check_packs()  # magic, footer, trailer: before anything is written
                for entry in manifest.files:
                    reader.materialize(entry, images / entry.name)
            yield images

    @contextlib.contextmanager
    def checkout_streamed(self, checkpoint_id: str, *, lazy: bool = False
                          ) -> Iterator[tuple[Path, ImageSource]]:
        """An empty directory (staging sized for the checkpoint's captured files, which a
        restore writes there) and the checkpoint's images read from the store as asked for,
        every byte verified (``CheckpointImages``), every pack's structure checked first as for
        ``checkout``. GC waits until the context ends: the
        packs are read while CRIU restores."""
        manifest = self.manifest(checkpoint_id, fresh=True)
        with (self._restore_dir(checkpoint_id, sum(f.size for f in manifest.record.files))
              as images, self.rw.shared()):
            reader = self.reader(checkpoint_id)
            if not lazy:
                reader.check_packs()  # magic, footer, trailer: before CRIU reads anything
            source = CheckpointImages(reader, manifest, plan_ahead=not lazy)
            try:
                yield images, source
            finally:
                source.close()

    @contextlib.contextmanager
    def _restore_dir(self, checkpoint_id: str, size: int) -> Iterator[Path]:
        """An empty ``images`` directory for a restore of ``checkpoint_id``, in the staging
        area with room for ``size`` bytes; removed when the context ends (off the restore's
        critical path)."""
        root = self._staging.choose(size) / f"restore-{checkpoint_id}-{secrets.token_hex(3)}"
        images = root / "images"
        images.mkdir(parents=True, mode=0o700)
        try:
            yield images
        finally:
            _remove_soon(root)

    # ---- page exchange (migration) ----------------------------------------------------------

    @property
    def store_id(self) -> str:
        """Equal for two daemons iff they share this store: a hash of its secret."""
        return hashlib.sha256(b"ckptd-store-id\0" + self._secret).hexdigest()[:32]

    def page_seed(self, uid: int) -> int:
        return self.hasher(uid).seed

    @contextlib.contextmanager
    def export(self, checkpoint_id: str, seed: int) -> Iterator[FrameExport]:
        """The checkpoint for another store's hash space (``FrameExport``): frames as stored,
        nothing materialized; GC waits until it closes."""
        manifest = self.manifest(checkpoint_id, fresh=True)
        with self.rw.shared():
            if any(p not in self.index.packs for p in manifest.packs):
                self.index.refresh(self._blobs)
            yield FrameExport(
                self._blobs, self.index, manifest, self.hasher(manifest.uid), self._executor,
                seed=seed, compression=self._compression,
            )

    def lacks(self, uid: int, refs: Sequence[bytes]) -> builtins.list[int]:
        del uid  # references are already in the uid's hash space
        self.index.refresh(self._blobs)  # packs another daemon sharing the store wrote
        live = self.index.live()
        return [i for i, r in enumerate(refs) if r != ZERO_REF and r not in live]

    def fill_pages(
        self, uid: int, path: Path, refs: Sequence[bytes], skip: frozenset[int]
    ) -> None:
        with self.rw.shared():
            PageSource(
                self._blobs, self.index, self.hasher(uid), self._executor, path.name
            ).write_pages(refs, path, skip)

    # ---- groups ---------------------------------------------------------------------------

    def put_group(self, group: GroupRecord) -> None:
        """The group record, written once every member is committed (on every member's
        store): what makes the group visible. GC keeps what its members' manifests name."""
        data = json.dumps(group.to_json(), sort_keys=True).encode()
        self._blobs.put(f"{GROUP_PREFIX}{group.id}.json", data, if_absent=True)
        self._blobs.flush()

    def list_groups(self) -> builtins.list[GroupRecord]:
        groups = []
        for key, _mtime in self._blobs.list(GROUP_PREFIX):
            with contextlib.suppress(BlobNotFound, ValueError, KeyError, TypeError):
                groups.append(GroupRecord.from_json(json.loads(self._blobs.get(key))))
        return sorted(groups, key=lambda g: (g.created, g.id))

    def page_refs(self, checkpoint_id: str) -> dict[str, builtins.list[bytes]]:
        """Page references per pages image (for tests and tools)."""
        reader = self.reader(checkpoint_id)
        return {f.name: reader.refs(f) for f in self.manifest(checkpoint_id).files if f.pagelist}

    def startup_check(self) -> StartupCheck:
        """What was found damaged when the index was built (``integrity``: every pack's
        footer and trailer, read at construction); for the daemon's start-up log."""
        return startup_check(self.index)

    def adopt_unauthenticated(self) -> Adoption:
        """Sign, once, the manifests written before manifests were authenticated (format 1)
        with this node's key (``integrity.adopt_unauthenticated``): trusts the store as it
        is now. The daemon calls it only when asked to (``adopt_unauthenticated``)."""
        with self.rw.exclusive():
            adoption = adopt_unauthenticated(self._blobs, self._keys, self.store_id)
        with self._mutex:
            self._manifests.clear()
            self._listed_mtimes.clear()
        return adoption

    def manifest_census(self) -> ManifestCensus:
        """Every manifest counted by the key id it names (``integrity.manifest_census``):
        for the daemon's start-up log."""
        return manifest_census(self._blobs, self._keys.ids)

    def verify(self, checkpoint_id: str = "") -> VerifyReport:
        return maintenance.verify(self, self._blobs, checkpoint_id)

    def collect_garbage(
        self,
        delete_first: tuple[str, ...] = (),
        *,
        grace_s: float | None = None,
        compact: bool = True,
        compact_below: float = COMPACT_BELOW,
    ) -> GcReport:
        """Delete ``delete_first``, condemn what no manifest names and delete what was
        condemned ``grace_s`` (default ``gc_grace_s``) ago and is still unreferenced; then,
        unless not ``compact``, rewrite the packs whose live share is below ``compact_below``
        (``compact``) and condemn (or delete) the packs that left unreferenced. A full store
        frees what it can and skips the rest (``GcReport.skipped``)."""
        return maintenance.collect_garbage(
            self,
            self._blobs,
            self._clock,
            delete_first=delete_first,
            grace_s=self.gc_grace_s if grace_s is None else grace_s,
            compact_below=compact_below if compact else 0.0,
        )

    def clean(self) -> builtins.list[str]:
        """Remove staging and restore directories a crash left (call with no operation
        running)."""
        removed = []
        lease = compact_lease_key(self._node)
        if self._blobs.exists(lease):  # a compaction killed midway (its packs: garbage)
            self._blobs.delete(lease)
            removed.append(lease)
        for root in self._staging_roots():
            removed += _empty(root)
        return removed


