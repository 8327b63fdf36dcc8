"""Store maintenance: garbage collection (mark, condemn, sweep), retention, verification.

GC marks every pack and blob a manifest names — any manifest, authenticated or not (ADR
0013: one this node refuses may be another node's, or not adopted yet). An unmarked object
is a *candidate* unless it was written since the oldest live lease started (a dump in
progress, here or on another node, may be about to name it). Candidates are not deleted at
once: a run lists the new ones in a condemned list (``condemned.py``) and deletes only those
an earlier run condemned at least
``grace_s`` ago (by default the lease TTL) and that are still candidates now. Meanwhile dumps
on every node store condemned objects again instead of reusing them, so an object that is due
is named by no dump that began after it was condemned, and one that began before it ran for
less than the lease TTL or finds the object due when it re-checks before its manifest.
``grace_s`` 0 deletes candidates at once (one daemon alone on its store, tests).

GC runs under the store's exclusive lock, so no dump of this daemon is between "found a page
in the index" and "manifest written" while it sweeps.

Order: what needs no new space comes first (issue 33, 3). A run marks, condemns and sweeps,
then compacts (``compact``: it writes new packs), then marks, condemns and sweeps again (what
compaction left unreferenced). A store whose filesystem is full (ENOSPC, EDQUOT) is freed all
the same: a compaction that finds no room is skipped (one line in ``GcReport.skipped``), and so
is a condemned list that cannot be written; each stops where a SIGKILL at that point would
(compaction's module docstring; a condemned list not written condemns nothing, one not yet
shrunk names objects that are no candidates: the sweep checks both), so no listed checkpoint
is left unrestorable, and the next run, once there is room, does the rest.

Dependencies point one way: ``cas.ContentStore`` calls this module; this module sees the store
only through ``MaintainedStore`` (what GC and verify need of it) and never imports ``cas``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from dataclasses import dataclass, field
from typing import Protocol

from ckptd.core.ports import BlobStore, Clock
from ckptd.core.store.compact import COMPACT_BELOW, CompactedStore, Compaction, compact
from ckptd.core.store.condemned import Condemned, CondemnedList, condemned_key, load_condemned
from ckptd.core.store.index import PACK_PREFIX, PageIndex, check_pack
from ckptd.core.store.manifest import Manifest, names_unverified
from ckptd.core.store.objects import BLOB_PREFIX, LEASE_PREFIX, MANIFEST_PREFIX
from ckptd.core.store.reader import CheckpointReader
from ckptd.core.store.rwlock import RWLock
from ckptd.domain import CheckpointRecord, GcReport, PinnedBy, VerifyReport
from ckptd.errors import BlobNotFound, CkptdError, CorruptCheckpoint, StoreError

DEFAULT_LEASE_TTL_S = 6 * 3600.0
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""What a full file system (or a spent quota) fails a write with."""


class MaintainedStore(CompactedStore, Protocol):
    """What GC and verify need of the content store (``cas.ContentStore`` is one)."""

    @property
    def rw(self) -> RWLock:
        """Shared by dumps and verify, exclusive for GC."""
        ...

    @property
    def index(self) -> PageIndex: ...

    def list(self) -> builtins.list[CheckpointRecord]: ...

    def manifest(self, checkpoint_id: str, *, fresh: bool = False) -> Manifest: ...

    def reader(self, checkpoint_id: str) -> CheckpointReader: ...

    def delete(self, checkpoint_id: str) -> None: ...

    def refresh_condemned(self) -> Condemned: ...


def collect_garbage(
    store: MaintainedStore,
    blobs: BlobStore,
    clock: Clock,
    *,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    grace_s: float = DEFAULT_LEASE_TTL_S,
    delete_first: tuple[str, ...] = (),
    compact_below: float = COMPACT_BELOW,
) -> GcReport:
    """Delete ``delete_first``; mark, condemn and sweep; compact (``compact``: rewrite the
    packs whose live share is below ``compact_below``, 0: never); then mark, condemn and sweep
    what compaction left unreferenced (module docstring). A full store (``NO_SPACE``) skips
    what needs new space, one line each in ``skipped``; any other failure raises."""
    for checkpoint_id in delete_first:
        store.delete(checkpoint_id)
    with store.rw.exclusive():
        skipped: builtins.list[str] = []
        swept = _sweep(store, blobs, clock, lease_ttl_s, grace_s, skipped)
        freed_first = swept.freed
        compaction, stopped = Compaction(), False
        if compact_below > 0:
            try:
                compaction = _compact(store, blobs, clock, lease_ttl_s, compact_below)
            except StoreError as exc:
                full = no_space(exc)
                if full is None:
                    raise
                # what it wrote before it stopped is what a SIGKILL there leaves (packs
                # nothing names yet, manifests naming the new packs): the sweep below
                # collects (or condemns) the packs nothing names
                stopped = True
                skipped.append(
                    f"compaction skipped: the store's filesystem is full "
                    f"({os.strerror(full.errno or errno.ENOSPC)}); freed {freed_first} bytes "
                    "first; run gc again once there is room"
                )
            if compaction.packs_rewritten or compaction.packs_written or stopped:
                swept = _sweep(store, blobs, clock, lease_ttl_s, grace_s, skipped, swept)
        store.refresh_condemned()
    return GcReport(
        deleted_checkpoints=delete_first,
        packs_deleted=swept.packs_deleted,
        blobs_deleted=swept.blobs_deleted,
        bytes_freed=swept.freed,
        packs_kept=swept.kept,
        bytes_kept=swept.kept_bytes,
        packs_rewritten=compaction.packs_rewritten,
        bytes_rewritten=compaction.bytes_rewritten,
        packs_written=compaction.packs_written,
        bytes_written=compaction.bytes_written,
        bytes_condemned=swept.condemned_bytes,
        pinned=_pinned(swept.named, swept.sizes),
        skipped=tuple(skipped),
    )


def no_space(exc: BaseException) -> OSError | None:
    """The ``OSError`` with a ``NO_SPACE`` errno that caused ``exc`` (``exc`` itself, or the
    error it was raised from: ``LocalBlobStore`` raises ``StoreError`` from the ``OSError``),
    else None."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain, never a cycle to follow for ever
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _sweep(
    store: MaintainedStore,
    blobs: BlobStore,
    clock: Clock,
    lease_ttl_s: float,
    grace_s: float,
    skipped: builtins.list[str],
    earlier: _Swept | None = None,
) -> _Swept:
    """Mark, condemn and sweep (module docstring); deletes first, then the one write (a new
    condemned list, then the old ones shrunk): a full store skips that write with a line in
    ``skipped`` (once per run). ``earlier``: this run's first sweep, whose deletions are
    added to this one's (what is kept is counted anew)."""
    live = _mark(store, blobs)
    now = clock.time()
    keep_after = _keep_after(blobs, clock, lease_ttl_s)
    condemned = load_condemned(blobs)
    swept = _Swept(named=live.named)
    if earlier is not None:
        swept.packs_deleted, swept.blobs_deleted = earlier.packs_deleted, earlier.blobs_deleted
        swept.freed = earlier.freed
    swept.packs(blobs, live, keep_after, grace_s, condemned.due_packs(now))
    swept.blobs(blobs, live, keep_after, grace_s, condemned.due_blobs(now))
    blobs.flush()
    store.index.drop_packs(swept.gone_packs)
    try:
        _update_condemned(blobs, condemned.lists, swept.pending_packs, swept.pending_blobs,
                          now, grace_s)
    except StoreError as exc:
        full = no_space(exc)
        if full is None:
            raise
        line = (f"condemning skipped: the store's filesystem is full "
                f"({os.strerror(full.errno or errno.ENOSPC)}); what no checkpoint needs is "
                "condemned by a run that finds room")
        if line not in skipped:
            skipped.append(line)
        # condemned: what a list names now (the new one may not have been written)
        listed = load_condemned(blobs).packs
        swept.condemned_bytes = sum(swept.sizes.get(p, 0) for p in swept.pending_packs
                                    if p in listed)
    for key in condemned.damaged:  # it condemned nothing; its objects are condemned anew
        blobs.delete(key)
    blobs.flush()
    return swept


def _compact(store: MaintainedStore, blobs: BlobStore, clock: Clock, lease_ttl_s: float,
             below: float) -> Compaction:
    """``compact`` over the listed checkpoints; what a refused manifest names stays put."""
    refused: set[str] = set()
    listed = {r.id for r in store.list()}
    for key, _mtime in blobs.list(MANIFEST_PREFIX):
        if key[len(MANIFEST_PREFIX) :] not in listed:
            with contextlib.suppress(BlobNotFound):
                refused.update(names_unverified(blobs.get(key))[0])
    return compact(store, blobs, clock, listed=sorted(listed), pinned_elsewhere=refused,
                   keep_after=_keep_after(blobs, clock, lease_ttl_s), below=below)


@dataclass
class _Live:
    """What some manifest names (mark)."""

    packs: set[str] = field(default_factory=set)
    blobs: set[str] = field(default_factory=set)
    named: dict[str, builtins.list[str]] = field(default_factory=dict)
    """Listed checkpoint -> the packs it names."""


def _mark(store: MaintainedStore, blobs: BlobStore) -> _Live:
    live = _Live()
    listed = {r.id for r in store.list()}
    for key, _mtime in blobs.list(MANIFEST_PREFIX):
        cid = key[len(MANIFEST_PREFIX) :]
        if cid in listed:
            manifest = store.manifest(cid)
            live.named[cid] = list(manifest.packs)
            live.packs.update(manifest.packs)
            live.blobs.update(manifest.blobs)
            continue
        # refused (unauthenticated, another node's key, edited): whatever it names is
        # kept, so a node given the wrong key, or a manifest not adopted yet, never makes
        # another node's data garbage (keeping too much costs space only)
        with contextlib.suppress(BlobNotFound):
            packs, named_blobs = names_unverified(blobs.get(key))
            live.packs.update(packs)
            live.blobs.update(named_blobs)
    return live


@dataclass
class _Swept:
    """What the sweep deleted, kept, and left condemned (candidates not deleted this time)."""

    packs_deleted: int = 0
    blobs_deleted: int = 0
    freed: int = 0
    kept: int = 0
    kept_bytes: int = 0
    condemned_bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    named: dict[str, builtins.list[str]] = field(default_factory=dict)
    """Listed checkpoint -> the packs it names (the mark's)."""
    gone_packs: set[str] = field(default_factory=set)
    pending_packs: set[str] = field(default_factory=set)
    pending_blobs: set[str] = field(default_factory=set)

    def packs(self, blobs: BlobStore, live: _Live, keep_after: float | None, grace_s: float,
              due: set[str]) -> None:
        for key, mtime in list(blobs.list(PACK_PREFIX)):
            pack_id = key.rsplit("/", 1)[-1]
            size = self.sizes[pack_id] = blobs.size(key)
            if pack_id in live.packs or (keep_after is not None and mtime >= keep_after):
                self.kept += 1
                self.kept_bytes += size
                continue
            if grace_s > 0 and pack_id not in due:
                self.pending_packs.add(pack_id)
                self.kept += 1
                self.kept_bytes += size
                self.condemned_bytes += size
                continue
            blobs.delete(key)
            self.gone_packs.add(pack_id)
            self.packs_deleted += 1
            self.freed += size

    def blobs(self, blobs: BlobStore, live: _Live, keep_after: float | None, grace_s: float,
              due: set[str]) -> None:
        for key, mtime in list(blobs.list(BLOB_PREFIX)):
            blob_hash = key.rsplit("/", 1)[-1]
            if blob_hash in live.blobs:
                continue
            if keep_after is not None and mtime >= keep_after:
                continue
            if grace_s > 0 and blob_hash not in due:
                self.pending_blobs.add(blob_hash)
                continue
            self.freed += blobs.size(key)
            blobs.delete(key)
            self.blobs_deleted += 1


def _keep_after(blobs: BlobStore, clock: Clock, lease_ttl_s: float) -> float | None:
    """Objects written since then may be named by a dump (or compaction) in progress, here
    or on another node: a minute before the oldest live lease started; None: no lease."""
    now = clock.time()
    starts = [mtime for _key, mtime in blobs.list(LEASE_PREFIX) if now - mtime < lease_ttl_s]
    return min(starts) - 60.0 if starts else None


def _pinned(
    named: dict[str, builtins.list[str]], sizes: dict[str, int]
) -> tuple[PinnedBy, ...]:
    """What each checkpoint keeps in the store: the packs it names, their bytes, and of
    those the bytes of packs no other checkpoint names (freed with it), largest first."""
    holders: dict[str, int] = {}
    for packs in named.values():
        for p in set(packs):
            holders[p] = holders.get(p, 0) + 1
    out = [
        PinnedBy(
            checkpoint_id=cid,
            packs=len(set(packs)),
            bytes=sum(sizes.get(p, 0) for p in set(packs)),
            bytes_alone=sum(sizes.get(p, 0) for p in set(packs) if holders[p] == 1),
        )
        for cid, packs in named.items()
    ]
    return tuple(sorted(out, key=lambda p: (-p.bytes, p.checkpoint_id)))


def _update_condemned(
    blobs: BlobStore,
    lists: builtins.list[CondemnedList],
    pending_packs: set[str],
    pending_blobs: set[str],
    now: float,
    grace_s: float,
) -> None:
    """Condemn the candidates no list names yet (a new list, written first), then shrink the
    old lists to what is still a candidate: an object deleted, or named by a manifest again,
    or stored again by a dump (lease-protected), is condemned no more."""
    known_packs = set().union(*(c.packs for c in lists)) if lists else set()
    known_blobs = set().union(*(c.blobs for c in lists)) if lists else set()
    new_packs, new_blobs = pending_packs - known_packs, pending_blobs - known_blobs
    if new_packs or new_blobs:
        entry = CondemnedList(
            condemned_key(now), now, now + grace_s, frozenset(new_packs), frozenset(new_blobs)
        )
        blobs.put(entry.key, entry.to_bytes())
        blobs.flush()
    for old in lists:
        kept = old.with_only(old.packs & pending_packs, old.blobs & pending_blobs)
        if not kept.packs and not kept.blobs:
            blobs.delete(old.key)
        elif kept != old:
            blobs.put(old.key, kept.to_bytes())
    blobs.flush()


def verify(store: MaintainedStore, blobs: BlobStore, checkpoint_id: str = "") -> VerifyReport:
    """Read back and check one checkpoint, or the whole store: every checkpoint, and every
    pack, named by a checkpoint or not.

    A checkpoint is checked whole: its manifest (authenticated, naming this checkpoint and
    store: ``Manifest.from_bytes``), the structure of every pack it names (magic, footer,
    trailer: ``index.check_pack``), and every page and image against its hash. Each problem
    names the checkpoint and the damaged object; a pack's structure is read once per run."""
    problems: builtins.list[str] = []
    ids: builtins.list[str] = []
    packs_checked = 0
    pack_problems: dict[str, str] = {}
    with store.rw.shared():
        if checkpoint_id:
            ids = [checkpoint_id]
        else:
            ids = [k[len(MANIFEST_PREFIX) :] for k, _ in blobs.list(MANIFEST_PREFIX)]
            for key, _ in blobs.list(PACK_PREFIX):
                packs_checked += 1
                pack_id = key.rsplit("/", 1)[-1]
                try:
                    check_pack(blobs, pack_id, store.index.packs.get(pack_id))
                except CkptdError as exc:
                    pack_problems[pack_id] = exc.message
                    problems.append(f"{key}: {exc.message}")
        for cid in ids:
            found = _verify_checkpoint(store, cid, pack_problems, whole=not checkpoint_id)
            packs_checked += found.packs_checked
            problems += [p for p in found.problems if p not in problems]
    return VerifyReport(checked=tuple(ids), problems=tuple(problems), packs_checked=packs_checked)


def _verify_checkpoint(
    store: MaintainedStore, cid: str, pack_problems: dict[str, str], *, whole: bool
) -> VerifyReport:
    """One checkpoint's problems; ``whole``: its packs' structure is in ``pack_problems``
    already (every pack was checked), else it is checked here."""
    problems: builtins.list[str] = []
    checked = 0
    try:
        manifest = store.manifest(cid, fresh=True)
        reader = store.reader(cid)
        if whole:
            bad = {p: pack_problems[p] for p in manifest.packs if p in pack_problems}
        else:
            bad = reader.pack_problems()
            checked = len(manifest.packs)
        problems += [f"checkpoint {cid}: {what}" for what in bad.values()]
        for entry in manifest.files:
            try:
                reader.check(entry)
            except CorruptCheckpoint as exc:
                if not any(pack_id in exc.message for pack_id in bad):  # named already
                    problems.append(
                        exc.message if cid in exc.message else f"{cid}: {exc.message}"
                    )
    except CorruptCheckpoint as exc:
        problems.append(exc.message if cid in exc.message else f"{cid}: {exc.message}")
    except CkptdError as exc:
        problems.append(f"checkpoint {cid}: {exc.message}")
    return VerifyReport(checked=(cid,), problems=tuple(problems), packs_checked=checked)
