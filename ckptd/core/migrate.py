"""The migrate recipe: a running tree moves to another node's daemon.

Order, and what undoes each step if a later one fails:

    connect     a mutual-TLS link to the target daemon                  close it
    probe       the target checks a preview of the checkpoint (this     -
                node's facts and the files the tree uses): refused
                here, before the tree is touched, if it cannot restore
    dump        checkpoint here, commit, kill the tree                  restore it HERE
    open        a transfer session on the target                        abort it there
    send        every image: pages offered as hashes in the target's    (open's undo)
                hash space, only the pages it lacks sent (zstd); none
                at all when both daemons share one store
    finish      the target commits and restores the tree                -

Invariants: the tree is killed only once its checkpoint is durable here; whatever fails after
that, the tree runs again here (restored from that checkpoint), except when the target may have
restored it already (the link broke during ``finish``): then nothing is restored twice, and the
error says where to look. The checkpoint stays in this node's store either way.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from ckptd.core.events import EventBus
from ckptd.core.ports import Clock, PageExchange, PeerConnector, PeerLink, PeerSession
from ckptd.core.recipe import ProgressSink, Step, run_steps
from ckptd.core.store import pagepath
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    DumpRequest,
    EventKind,
    MigrateOutcome,
    MigrateRequest,
    PeerProbe,
    RemoteRestore,
    RestoreOutcome,
    RestoreRequest,
)
from ckptd.errors import CkptdError, Incompatible, InvalidTarget, PeerError

OFFER_PAGES = 1 << 20
"""Page references per offer message (16 MiB): any image size fits the message limit."""
BATCH_PAGES = 256
"""Pages per message: 1 MiB before compression."""
PREFETCH = 8

Dumper = Callable[[Caller, DumpRequest, ProgressSink], CheckpointRecord]
Previewer = Callable[[Caller, DumpRequest], CheckpointRecord]
"""The record a dump would make now, touching nothing (``DumpRecipe.preview``)."""
LocalRestorer = Callable[[Caller, RestoreRequest], RestoreOutcome]


@dataclass
class MigrateContext:
    caller: Caller
    request: MigrateRequest
    progress: ProgressSink
    started: float = 0.0
    link: PeerLink | None = None
    probe: PeerProbe | None = None
    record: CheckpointRecord | None = None
    session: PeerSession | None = None
    remote: RemoteRestore | None = None
    in_doubt: bool = False
    """The link broke while the target was restoring: it may be running there."""
    restored_here: RestoreOutcome | None = None
    pages_total: int = 0
    pages_sent: int = 0
    bytes_sent: int = 0
    transfer_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class MigrateRecipe:
    def __init__(
        self,
        *,
        preview: Previewer,
        dump: Dumper,
        restore_here: LocalRestorer,
        pages: PageExchange,
        connector: PeerConnector,
        clock: Clock,
        executor: Executor,
        is_pages_file: Callable[[str], bool],
        level: int = 1,
        events: EventBus | None = None,
    ) -> None:
        self._events = events
        self._preview = preview
        self._dump = dump
        self._restore_here = restore_here
        self._pages = pages
        self._connector = connector
        self._clock = clock
        self._executor = executor
        self._is_pages_file = is_pages_file
        self._level = level
        self.steps: tuple[Step[MigrateContext], ...] = (
            Step("connect", self._connect, self._disconnect, "connecting to the target daemon"),
            Step("probe", self._probe, None, "asking the target whether it can restore"),
            Step("dump", self._dump_here, self._restore_back, "checkpointing the tree here"),
            Step("open", self._open, self._abort, "opening the transfer"),
            Step("send", self._send, None, "sending the pages the target lacks"),
            Step("finish", self._finish, None, "the target commits and restores"),
        )

    def run(
        self, caller: Caller, request: MigrateRequest, progress: ProgressSink
    ) -> MigrateOutcome:
        if not request.to or ":" not in request.to:
            raise InvalidTarget(
                f"bad target address {request.to!r}", hint="give host:port of its peer listener",
                pid=request.pid,
            )
        ctx = MigrateContext(caller, request, progress, started=self._clock.monotonic())
        try:
            run_steps(self.steps, ctx, progress)
        except CkptdError as exc:
            exc.pid = exc.pid or request.pid
            if ctx.record is not None:
                exc.checkpoint_id = exc.checkpoint_id or ctx.record.id
            if ctx.notes:
                exc.message = f"{exc.message}; " + "; ".join(ctx.notes)
            if self._events is not None:
                self._events.publish(
                    EventKind.MIGRATE_FAILED, pid=request.pid, uid=caller.uid,
                    checkpoint_id=exc.checkpoint_id or "", message=str(exc),
                    error=type(exc).__name__, to=request.to,
                )
            raise
        finally:
            if ctx.link is not None:
                ctx.link.close()
        assert ctx.record is not None and ctx.remote is not None and ctx.probe is not None
        outcome = MigrateOutcome(
            checkpoint_id=ctx.record.id,
            node=ctx.remote.node,
            address=request.to,
            pid=ctx.remote.pid,
            output_path=ctx.remote.output_path,
            pages_total=ctx.pages_total,
            pages_sent=ctx.pages_sent,
            bytes_sent=ctx.bytes_sent,
            frozen_s=ctx.record.frozen_s,
            downtime_s=self._clock.monotonic() - ctx.started,
            transfer_s=ctx.transfer_s,
            shared_store=ctx.probe.store_id == self._pages.store_id,
        )
        if self._events is not None:
            self._events.publish(
                EventKind.MIGRATE_DONE, pid=outcome.pid, uid=caller.uid,
                checkpoint_id=outcome.checkpoint_id,
                name=request.name, message=f"moved to {outcome.node} ({outcome.address})",
                to=request.to, bytes_sent=outcome.bytes_sent, pages_sent=outcome.pages_sent,
                downtime_s=outcome.downtime_s,
            )
        return outcome

    # ---- steps ------------------------------------------------------------------------------

    def _connect(self, ctx: MigrateContext) -> None:
        ctx.link = self._connector.connect(ctx.request.to)

    def _disconnect(self, ctx: MigrateContext) -> None:
        if ctx.link is not None:
            ctx.link.close()
            ctx.link = None

    def _probe(self, ctx: MigrateContext) -> None:
        assert ctx.link is not None
        preview = self._preview(ctx.caller, self._dump_request(ctx))
        ctx.probe = ctx.link.probe(preview)
        report = ctx.probe.report
        if report.blocking or (report.warnings and not ctx.request.ignore_warnings):
            parts = [f"blocking: {b}" for b in report.blocking]
            parts += [f"warning: {w}" for w in report.warnings]
            raise Incompatible(
                f"node {ctx.probe.node} ({ctx.request.to}) cannot restore pid "
                f"{ctx.request.pid}: " + "; ".join(parts),
                hint="nothing was touched; pick another node"
                + ("" if report.blocking else " or migrate with --ignore-warnings"),
                blocking=report.blocking,
                warnings=report.warnings,
                pid=ctx.request.pid,
            )
        # the clock of the downtime starts when the tree is frozen
        ctx.started = self._clock.monotonic()

    def _dump_here(self, ctx: MigrateContext) -> None:
        ctx.record = self._dump(ctx.caller, self._dump_request(ctx), ctx.progress)

    def _restore_back(self, ctx: MigrateContext) -> None:
        if ctx.record is None:
            return  # the dump failed: its own rollback left the tree running
        if ctx.in_doubt:
            ctx.notes.append(
                f"the link broke while {ctx.request.to} was restoring: check there whether "
                f"pid {ctx.record.pid} runs; if not, `ckptctl restore {ctx.record.id}` here"
            )
            return
        try:
            ctx.restored_here = self._restore_here(
                ctx.caller, RestoreRequest(checkpoint_id=ctx.record.id)
            )
        except CkptdError as exc:
            ctx.notes.append(
                f"restoring it on this node failed too ({exc.message}); its checkpoint is "
                f"kept: `ckptctl restore {ctx.record.id}`"
            )
            return
        ctx.notes.append(
            f"the tree was restored on this node as pid {ctx.restored_here.pid} from "
            f"{ctx.record.id}"
        )

    def _open(self, ctx: MigrateContext) -> None:
        assert ctx.link is not None and ctx.record is not None
        ctx.session = ctx.link.open(ctx.record, ctx.request.ignore_warnings)

    def _abort(self, ctx: MigrateContext) -> None:
        if ctx.session is not None and not ctx.in_doubt:
            ctx.session.abort()

    def _send(self, ctx: MigrateContext) -> None:
        assert ctx.session is not None and ctx.record is not None and ctx.probe is not None
        if ctx.probe.store_id == self._pages.store_id:
            return  # one store: the target reads the checkpoint where this node wrote it
        started = self._clock.monotonic()
        session = ctx.session
        hasher = PageHasher.from_seed(session.page_seed)
        with self._pages.checkout(ctx.record.id) as images:
            wanted: list[tuple[Path, list[int]]] = []
            for path in sorted(images.iterdir()):
                size = path.stat().st_size
                if self._is_pages_file(path.name) and size % PAGE_SIZE == 0:
                    refs = _page_refs(path, size, hasher)
                    ctx.pages_total += sum(1 for r in refs if r != ZERO_REF)
                    missing = []
                    for first in range(0, max(len(refs), 1), OFFER_PAGES):
                        chunk = b"".join(refs[first : first + OFFER_PAGES])
                        missing += session.offer_pages(path.name, size, chunk, first)
                        ctx.bytes_sent += len(chunk)
                    if missing:
                        wanted.append((path, missing))
                else:
                    data = path.read_bytes()
                    session.offer_file(path.name, data)
                    ctx.bytes_sent += len(data)
            counted = _Counting(self._batches(wanted))
            ctx.pages_sent = session.send(iter(counted))
            ctx.bytes_sent += counted.bytes
        ctx.transfer_s = self._clock.monotonic() - started

    def _finish(self, ctx: MigrateContext) -> None:
        assert ctx.session is not None
        try:
            ctx.remote = ctx.session.finish(ctx.request.output_path)
        except PeerError as exc:
            ctx.in_doubt = exc.in_doubt
            raise

    # ---- helpers ----------------------------------------------------------------------------

    def _dump_request(self, ctx: MigrateContext) -> DumpRequest:
        return DumpRequest(
            pid=ctx.request.pid, leave_running=False, name=ctx.request.name,
            labels=dict(ctx.request.labels),
        )

    def _batches(
        self, wanted: list[tuple[Path, list[int]]]
    ) -> Iterator[tuple[str, int, int, bytes]]:
        """``(image, first, count, zstd)`` for every run of missing pages, compressed a few
        batches ahead on the executor."""
        ahead: deque[tuple[str, int, int, Future[bytes]]] = deque()
        level = self._level
        for path, missing in wanted:
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for first, count in _runs(missing, BATCH_PAGES):
                    chunk = mm[first * PAGE_SIZE : (first + count) * PAGE_SIZE]
                    ahead.append(
                        (path.name, first, count, self._executor.submit(_compress, chunk, level))
                    )
                    while len(ahead) >= PREFETCH:
                        name, f, c, fut = ahead.popleft()
                        yield name, f, c, fut.result()
                while ahead:
                    name, f, c, fut = ahead.popleft()
                    yield name, f, c, fut.result()


class _Counting:
    """Counts the compressed bytes of the batches that go through it."""

    def __init__(self, batches: Iterator[tuple[str, int, int, bytes]]) -> None:
        self._batches = batches
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, int, int, bytes]]:
        for batch in self._batches:
            self.bytes += len(batch[3]) + len(batch[0]) + 8
            yield batch


def _compress(data: bytes, level: int) -> bytes:
    return bytes(zstandard.ZstdCompressor(level=level).compress(data))


def _page_refs(path: Path, size: int, hasher: PageHasher) -> list[bytes]:
    """Every page's reference in ``hasher``'s hash space (ZERO_REF for zero pages): one
    native call for the whole image (``pagepath``)."""
    if size == 0:
        return []
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)[:size]
        try:
            refs = pagepath.hash_pages(view, hasher.seed, zero_ref=True)
        finally:
            view.release()
    return [refs[i : i + HASH_SIZE] for i in range(0, len(refs), HASH_SIZE)]


def _runs(indices: list[int], limit: int) -> Iterator[tuple[int, int]]:
    """(first, count) of runs of consecutive ``indices`` (sorted), at most ``limit`` long."""
    first = count = 0
    for i in indices:
        if count and i == first + count and count < limit:
            count += 1
            continue
        if count:
            yield first, count
        first, count = i, 1
    if count:
        yield first, count
