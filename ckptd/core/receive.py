"""The target side of a migration: another daemon hands this one a checkpoint, page by page.

A session is: ``open`` (this node checks it can restore the record, before anything is sent;
an empty image directory is staged in the store under a lease), ``offer`` each image (pages
images as page references in this store's hash space: the answer is which pages it lacks;
other images whole, maybe as a zstd frame), ``receive`` the missing pages in frames (``PageFrame``:
the sender's stored frames as they are, zstd or raw, with the places of their pages; each page
verified against the reference offered for each of its places, then written there; a frame
whose pages are all new to this store is kept as it is for the commit, ``FrameKeeper``),
``finish`` (the rest of every pages image is filled from this store, the tree is restored by
the restore recipe from those verified images, then the checkpoint is committed like a local
dump, in the background: the job does not wait for the ingest, and kept frames go into packs
without being compressed again). ``abort``, a failure, or ``session_ttl_s`` of silence drop
the staging.

Invariants: nothing is listed before the commit completes (a failed one keeps nothing here;
the sender keeps the checkpoint either way); a page is written (or kept) only if it hashes
to the reference offered for its place, so a checkpoint assembled here restores exactly what
was dumped there — a damaged frame fails the transfer, and the sender restores the job at
home; when the record's id is already in this store (a shared store) nothing is sent and
``finish`` only restores it.

What the target did with each checkpoint it was sent is durable (``core.undo.Received``, in its
journal): the restore's own journal entry ends into "restored" in one atomic write once the tree
runs, so a target killed while restoring (its tree killed at its restart, its entry replayed)
has no record of it. A source whose link broke during ``finish`` asks (``received``): restored
(it runs here), still restoring (ask again), or not: then a fence is written first, and a
fenced checkpoint is never restored here (``finish`` refuses it). The answer and the start of a
restore exclude each other (one lock): the job never runs on both nodes.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ckptd.core.compat import refuse_unless_compatible
from ckptd.core.ports import (
    CheckpointCatalog,
    CheckpointStaging,
    Clock,
    FrameKeeper,
    Journal,
    PageExchange,
    PageFrame,
)
from ckptd.core.store import pagepath
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.core.undo import Received, received_op_id
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    PeerProbe,
    ReceivedState,
    RemoteRestore,
    RestoreOutcome,
    RestoreRequest,
)
from ckptd.domain.model import is_checkpoint_id
from ckptd.errors import (
    Busy,
    CheckpointNotFound,
    CorruptCheckpoint,
    InvalidTarget,
    PreconditionFailed,
    StoreError,
)

log = logging.getLogger(__name__)

_IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_FRAME_PAGES = 4096
"""Largest frame accepted in one message (16 MiB decompressed)."""
MAX_PAGES_IMAGE = 1 << 46
"""Largest pages image offered (64 TiB: more than any node's memory; a file can have it)."""
MAX_FILE_IMAGE = 1 << 32
"""Largest image other than a pages image accepted whole (``offer_file``): what a zstd frame
of unknown content size may be decompressed into."""

Restorer = Callable[
    [RestoreRequest, "tuple[CheckpointRecord, Path] | None", Received], RestoreOutcome]
"""Restore a request; with (record, images): from those staged images; its journal entry ends
into the ``Received`` record once the tree runs (``CheckpointService.restore``)."""
Checker = Callable[[CheckpointRecord], CompatReport]


@dataclass
class _Session:
    record: CheckpointRecord
    images: Path | None
    """Staged image directory; None when the store holds the checkpoint already."""
    hasher: PageHasher
    touched: float
    refs: dict[str, bytearray] = field(default_factory=dict)
    """Per pages image: every page's reference offered so far, 16 bytes each (grown as
    offered: memory follows what the sender sent, not the size it declares)."""
    pages: dict[str, int] = field(default_factory=dict)
    """Per pages image: how many pages it has (its declared size)."""
    offered: dict[str, int] = field(default_factory=dict)
    missing: dict[str, set[int]] = field(default_factory=dict)
    received: dict[str, set[int]] = field(default_factory=dict)
    keeper: FrameKeeper | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReceivingStore(CheckpointStaging, CheckpointCatalog, Protocol):
    """What a migration's target needs of its store: stage, commit or abort, read."""


class Receiver:
    """Sessions of checkpoints coming from other daemons. Thread-safe."""

    def __init__(
        self,
        *,
        store: ReceivingStore,
        pages: PageExchange,
        check: Checker,
        restore: Restorer,
        clock: Clock,
        node: str,
        session_ttl_s: float = 600.0,
        journal: Journal | None = None,
    ) -> None:
        """``journal``: where the ``Received`` records live (without one, in memory: they
        do not outlive this object)."""
        self._store = store
        self._pages = pages
        self._check = check
        self._restore = restore
        self._clock = clock
        self.node = node
        self._ttl = session_ttl_s
        self._sessions: dict[str, _Session] = {}
        self._commits: list[threading.Thread] = []
        self._mutex = threading.Lock()
        self._journal = journal
        self._records: dict[str, Received] = {}
        """Without a journal: the records."""
        self._finishing: set[str] = set()
        """Checkpoint ids whose ``finish`` runs now (assembling or restoring)."""

    # ---- before anything is sent ------------------------------------------------------------

    def probe(self, record: CheckpointRecord) -> PeerProbe:
        if record.id:  # a preview may have none yet
            _check_record(record)
        return PeerProbe(
            node=self.node,
            store_id=self._pages.store_id,
            report=self._check(record),
            has_checkpoint=self._has(record.id),
        )

    def open(self, record: CheckpointRecord, *, ignore_warnings: bool) -> tuple[str, int]:
        """A new session for ``record``: (session id, page seed of its uid). Raises
        Incompatible (every difference) when this node cannot restore it."""
        self.expire()
        _check_record(record)
        refuse_unless_compatible(record, self._check(record), ignore_warnings=ignore_warnings)
        with self._mutex:
            if any(s.record.id == record.id for s in self._sessions.values()):
                raise Busy(
                    f"checkpoint {record.id} is being received already",
                    checkpoint_id=record.id,
                )
            session_id = f"s{secrets.token_hex(8)}"
            self._sessions[session_id] = _Session(
                record=record,
                images=None,
                hasher=PageHasher.from_seed(self._pages.page_seed(record.uid)),
                touched=self._clock.monotonic(),
            )
        if not self._has(record.id):
            try:
                images = self._store.begin(record.id, sum(p.rss for p in record.processes))
            except BaseException:
                with self._mutex:
                    self._sessions.pop(session_id, None)
                raise
            session = self._sessions[session_id]
            session.images = images
            session.keeper = self._pages.frame_keeper(record.id, record.uid)
        return session_id, self._sessions[session_id].hasher.seed

    # ---- the images -------------------------------------------------------------------------

    def offer_pages(
        self, session_id: str, name: str, size: int, refs: bytes, first: int = 0
    ) -> list[int]:
        """Pages ``first ..`` of image ``name`` (``size`` bytes in all), as references: the
        indices of those this store lacks (to be sent). An image is offered in slices, in
        order, starting at page 0 (which creates it)."""
        s = self._session(session_id)
        images = s.images
        if images is None:
            return []
        _check_name(name, s.record.id)
        count, rest = divmod(len(refs), HASH_SIZE)
        total, partial = divmod(size, PAGE_SIZE)
        if rest or partial or first < 0 or first + count > total or size > MAX_PAGES_IMAGE:
            raise InvalidTarget(
                f"image {name}: {len(refs)} bytes of references at page {first} do not fit "
                f"{size} bytes of pages",
                checkpoint_id=s.record.id,
            )
        with s.lock:
            if first == 0:
                s.refs[name] = bytearray()
                s.pages[name] = total
                s.offered[name] = 0
                s.missing[name] = set()
                s.received[name] = set()
                try:
                    fd = os.open(images / name,
                                 os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                    try:
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
                except OSError as exc:
                    raise StoreError(f"image {name} of {size} bytes cannot be staged: "
                                     f"{exc.strerror}", checkpoint_id=s.record.id) from exc
            elif s.offered.get(name) != first or s.pages.get(name) != total:
                raise InvalidTarget(
                    f"image {name}: pages offered out of order (at {first} of {total}, "
                    f"expected {s.offered.get(name, 0)} of {s.pages.get(name, 0)})",
                    checkpoint_id=s.record.id,
                )
            s.refs[name] += refs  # at its end: ``first`` is what was offered so far
            s.offered[name] = first + count
        chunk = [refs[i : i + HASH_SIZE] for i in range(0, len(refs), HASH_SIZE)]
        missing = [first + i for i in self._pages.lacks(s.record.uid, chunk)]
        with s.lock:
            s.missing[name].update(missing)
        return missing

    def offer_file(
        self, session_id: str, name: str, data: bytes, size: int | None = None
    ) -> None:
        """Image ``name`` whole: ``data``, or with ``size`` a zstd frame of its ``size``
        bytes."""
        s = self._session(session_id)
        images = s.images
        if images is None:
            return
        _check_name(name, s.record.id)
        if size is not None:
            if not 0 <= size <= MAX_FILE_IMAGE:
                raise InvalidTarget(f"image {name}: {size} bytes offered whole",
                                    checkpoint_id=s.record.id)
            data = _decompress(data, size, f"image {name}", s.record.id)
        (images / name).write_bytes(data)

    def receive(self, session_id: str, frame: PageFrame) -> int:
        """The pages of ``frame`` at their places (``frame.runs``); each must hash to the
        reference offered for each of its places (else CorruptCheckpoint, and nothing of the
        frame is written or kept). A frame whose every page was verified is offered to the
        store's keeper as it is. Returns the places filled."""
        s = self._session(session_id)
        images = s.images
        if images is None:
            return 0
        cid = s.record.id
        if not frame.runs or not 0 < frame.pages <= MAX_FRAME_PAGES:
            raise InvalidTarget(
                f"a frame of {frame.pages} pages with {len(frame.runs)} places",
                checkpoint_id=cid,
            )
        for name, dst, src, count in frame.runs:
            refs = s.refs.get(name)
            if refs is None:
                raise InvalidTarget(f"image {name} was not offered", checkpoint_id=cid)
            if (count <= 0 or min(dst, src) < 0 or src + count > frame.pages
                    or (dst + count) * HASH_SIZE > len(refs)):
                raise InvalidTarget(
                    f"image {name}: pages {dst}..{dst + count - 1} (frame pages {src}.."
                    f"{src + count - 1} of {frame.pages}) out of range", checkpoint_id=cid,
                )
        if frame.raw:
            data = frame.data
            if len(data) != frame.pages * PAGE_SIZE:
                raise CorruptCheckpoint(
                    f"a raw frame of {frame.pages} pages holds {len(data)} bytes",
                    checkpoint_id=cid,
                )
        else:
            data = _decompress(frame.data, frame.pages * PAGE_SIZE, "a frame", cid)
        view = memoryview(data)
        hashes = bytearray(frame.pages * HASH_SIZE)
        covered = bytearray(frame.pages)
        writes: dict[str, list[tuple[int, int, int]]] = {}
        for name, dst, src, count in frame.runs:
            wants = bytes(s.refs[name][dst * HASH_SIZE : (dst + count) * HASH_SIZE])
            bad = [i for i in (_zero_ref_at(wants), pagepath.verify_pages(  # one native call
                view[src * PAGE_SIZE : (src + count) * PAGE_SIZE], wants, s.hasher.seed))
                if i >= 0]
            if bad:
                raise CorruptCheckpoint(
                    f"image {name}: page {dst + min(bad)} does not match its hash",
                    checkpoint_id=cid,
                )
            hashes[src * HASH_SIZE : (src + count) * HASH_SIZE] = wants
            covered[src : src + count] = b"\x01" * count
            writes.setdefault(name, []).append((dst, src, count))
        for name, runs in writes.items():
            fd = os.open(images / name, os.O_WRONLY | os.O_CLOEXEC)
            try:
                pagepath.write_runs(fd, data, runs)
            finally:
                os.close(fd)
        with s.lock:
            for name, dst, _src, count in frame.runs:
                s.received[name].update(range(dst, dst + count))
        if s.keeper is not None and covered.count(0) == 0:
            s.keeper.keep(frame, [bytes(hashes[i : i + HASH_SIZE])
                                  for i in range(0, len(hashes), HASH_SIZE)])
        return frame.places

    # ---- the end ----------------------------------------------------------------------------

    def finish(self, session_id: str, output_path: str) -> RemoteRestore:
        """Assemble the images (every page the sender was asked for must have arrived, the
        rest comes from this store), restore the tree from them, then commit the checkpoint
        to this store in the background (the job does not wait for the ingest). The session
        ends whatever happens; a failed restore keeps nothing."""
        s = self._session(session_id)
        cid = s.record.id
        with self._mutex:
            fenced = self._record(cid)
            if fenced is not None and not fenced.restored:
                self._sessions.pop(session_id, None)
            elif cid in self._finishing:
                raise Busy(f"checkpoint {cid} is being restored already", checkpoint_id=cid)
            else:
                self._finishing.add(cid)
        if fenced is not None and not fenced.restored:
            if s.images is not None:
                self._store.abort(cid)
            raise PreconditionFailed(
                f"checkpoint {cid} is settled as not restored on {self.node}: its source "
                "asked after the link broke, and restores it itself",
                hint="nothing was restored here; see the source's migrate.settled event",
                checkpoint_id=cid,
            )
        s.touched = float("inf")  # finishing: never expired while the restore runs
        staged: tuple[CheckpointRecord, Path] | None = None
        try:
            images = s.images
            assembling = self._clock.monotonic()
            if images is not None:
                self._assemble(s, images)
                staged = (s.record, images)
            started = self._clock.monotonic()
            request = RestoreRequest(checkpoint_id=s.record.id, output_path=output_path,
                                     ignore_warnings=True)  # warnings were accepted at open
            outcome = self._restore(request, staged, Received(
                cid, restored=True, output_path=output_path, time=self._clock.time()))
            self._put(Received(cid, restored=True, pid=outcome.pid,
                               output_path=outcome.output_path, time=self._clock.time()))
            if staged is not None:
                s.images = None  # the background commit owns the staging now
                self._commit_later(s.record)
            log.info("restored migrated checkpoint %s: assembled in %.2fs, restored in %.2fs",
                     s.record.id, started - assembling, self._clock.monotonic() - started)
            return RemoteRestore(
                checkpoint_id=outcome.checkpoint_id,
                pid=outcome.pid,
                output_path=outcome.output_path,
                node=self.node,
                restore_s=self._clock.monotonic() - started,
            )
        finally:
            with self._mutex:
                self._finishing.discard(cid)
            self._drop(session_id)

    def received(self, checkpoint_id: str) -> ReceivedState:
        """What this node did with ``checkpoint_id`` (a migration's source asks after its link
        broke during ``finish``), from its durable records: restored, still restoring (a
        ``finish`` of it runs now), or neither: then a fence is written before the answer, and
        ``finish`` refuses that checkpoint from now on."""
        _check_record_id(checkpoint_id)
        with self._mutex:
            if checkpoint_id in self._finishing:
                return ReceivedState(checkpoint_id, self.node, restoring=True)
            record = self._record(checkpoint_id)
            if record is None:  # never restored here (a restore killed with us left none)
                record = Received(checkpoint_id, restored=False, time=self._clock.time())
                self._put(record)
                log.warning("migrated checkpoint %s was never restored here: fenced (its "
                            "source restores it)", checkpoint_id)
        return ReceivedState(checkpoint_id, self.node, restored=record.restored,
                             pid=record.pid, output_path=record.output_path)

    def _record(self, checkpoint_id: str) -> Received | None:
        if self._journal is None:
            return self._records.get(checkpoint_id)
        op_id = received_op_id(checkpoint_id)
        for pending, facts in self._journal.pending():
            if pending == op_id:
                return Received.from_facts(facts)  # None: a restore's entry, not ended
        return None

    def _put(self, record: Received) -> None:
        if self._journal is None:
            self._records[record.checkpoint_id] = record
        else:
            self._journal.begin(received_op_id(record.checkpoint_id), record.facts())

    def _assemble(self, s: _Session, images: Path) -> None:
        for name, refs in s.refs.items():
            if s.offered[name] != s.pages[name]:
                raise StoreError(
                    f"image {name}: only {s.offered[name]} of {s.pages[name]} pages "
                    "were offered",
                    checkpoint_id=s.record.id,
                )
            lost = s.missing[name] - s.received[name]
            if lost:
                raise StoreError(
                    f"image {name}: {len(lost)} page(s) the sender was asked for never arrived",
                    checkpoint_id=s.record.id,
                )
            page_refs = [bytes(refs[i : i + HASH_SIZE]) for i in range(0, len(refs), HASH_SIZE)]
            self._pages.fill_pages(
                s.record.uid, images / name, page_refs, frozenset(s.received[name])
            )

    def _commit_later(self, record: CheckpointRecord) -> None:
        def commit() -> None:
            try:
                self._store.commit(record)
            except Exception:
                log.exception("migrated checkpoint %s restored, but its commit here failed "
                              "(the sender keeps it)", record.id)
                self._store.abort(record.id)

        thread = threading.Thread(target=commit, name=f"commit-{record.id}", daemon=True)
        with self._mutex:
            self._commits = [t for t in self._commits if t.is_alive()] + [thread]
        thread.start()

    def wait_commits(self, timeout: float | None = None) -> bool:
        """Wait for the background commits; True when none is left running."""
        with self._mutex:
            threads = list(self._commits)
        for thread in threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in threads)

    def abort(self, session_id: str) -> None:
        self._drop(session_id)

    def expire(self) -> list[str]:
        """Drop sessions idle longer than the TTL (a sender that went away). Returns them."""
        now = self._clock.monotonic()
        with self._mutex:
            stale = [k for k, s in self._sessions.items() if now - s.touched > self._ttl]
        for key in stale:
            self._drop(key)
        return stale

    # ---- helpers ----------------------------------------------------------------------------

    def _has(self, checkpoint_id: str) -> bool:
        try:
            self._store.get(checkpoint_id)
        except CheckpointNotFound:
            return False
        return True

    def _session(self, session_id: str) -> _Session:
        with self._mutex:
            s = self._sessions.get(session_id)
        if s is None:
            raise InvalidTarget(
                f"no transfer session {session_id!r} (it ended, or expired after "
                f"{self._ttl:.0f}s idle)",
                hint="start the migration again",
            )
        s.touched = self._clock.monotonic()
        return s

    def _drop(self, session_id: str) -> None:
        with self._mutex:
            s = self._sessions.pop(session_id, None)
        if s is not None and s.images is not None:
            self._store.abort(s.record.id)


def _check_record(record: CheckpointRecord) -> None:
    """A record from another daemon names files here by its id: only a well-formed one."""
    _check_record_id(record.id)


def _check_record_id(checkpoint_id: str) -> None:
    if not is_checkpoint_id(checkpoint_id):
        raise InvalidTarget(f"bad checkpoint id {checkpoint_id[:80]!r} from the sender")


def _decompress(zdata: bytes, size: int, what: str, checkpoint_id: str) -> bytes:
    """``zdata`` (a zstd or LZ4 frame) decompressed: exactly ``size`` bytes, or
    CorruptCheckpoint."""
    try:
        data = pagepath.decompress_frame(zdata, size)
    except ValueError as exc:
        raise CorruptCheckpoint(
            f"{what} does not decompress to {size} bytes: {exc}", checkpoint_id=checkpoint_id
        ) from exc
    return data


def _zero_ref_at(refs: bytes) -> int:
    """Index of the first ZERO_REF among ``refs`` (16 bytes each), -1 if none: a zero
    page's place, never asked for (no content can be verified against it)."""
    at = refs.find(ZERO_REF)
    while at >= 0:
        if at % HASH_SIZE == 0:
            return at // HASH_SIZE
        at = refs.find(ZERO_REF, at + 1)
    return -1


def _check_name(name: str, checkpoint_id: str) -> None:
    if not _IMAGE_NAME.match(name) or ".." in name:
        raise InvalidTarget(f"bad image name {name!r}", checkpoint_id=checkpoint_id)
