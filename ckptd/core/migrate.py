"""The migrate recipe: a running tree moves to another node's daemon.

Order, and what undoes each step if a later one fails (before any, the preview of the dump
here: the local refusals, pid 1, no such pid, not the caller's, come before the target is
contacted):

    connect     a mutual-TLS link to the target daemon                  close it
    probe       the target checks a preview of the checkpoint (this     -
                node's facts and the files the tree uses): refused
                here, before the tree is touched, if it cannot restore
    dump        checkpoint here, commit, kill the tree                  restore it HERE
    open        a transfer session on the target                        abort it there
    send        every image: pages offered as hashes in the target's    (open's undo)
                hash space, only the pages it lacks sent, in this
                store's frames as they are (zstd or raw) when all of a
                frame's pages are wanted; none at all when both
                daemons share one store
    finish      the target commits and restores the tree                -

Durable undo (``core.undo``, with a journal): the dump's gate, before its commit, journals
RestoreHere of the checkpoint; ``finish``, before it asks the target, replaces it with InDoubt.
A daemon killed after the dump has the tree restored here at its restart (after the dump's
own entry was recovered); one killed during ``finish`` asks the target after its restart
(``core.settle``). The target forgets a transfer session its source never finished (its TTL):
the ``open`` step's undo needs no record.

When the link breaks during ``finish`` (the target may have restored the tree, or died while
restoring it), the target is asked what it did (``core.settle``: until it answers, with
backoff, for ``Settler.within_s``): it restored it — the migration succeeded; it did not (and
from that answer on never will) — the tree is restored here, as after any other failure; no
answer in time — nothing is restored, the entry stays journaled, the next start asks again.
An event ``migrate.settled`` says which side runs it.

Invariants: the tree is killed only once its checkpoint is durable here; whatever fails after
that, the tree runs again here (restored from that checkpoint), except when the target may have
restored it already (the link broke during ``finish``): then it is restored here only once the
target said it never restored it (a durable fence there), so it never runs twice. The
checkpoint stays in this node's store either way. Every page the
target restores was verified there against the hash offered for its place, which this node
computed from content verified against its own store (``ckptd.core.store.export``): a frame
damaged on the way fails ``send``, and the job runs here again.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ckptd.core.events import EventBus
from ckptd.core.ports import (
    Clock,
    Journal,
    PageExchange,
    PageFrame,
    PeerConnector,
    PeerLink,
    PeerSession,
)
from ckptd.core.recipe import ProgressSink, Step, run_steps
from ckptd.core.rollback import BackHere
from ckptd.core.settle import SETTLE_WITHIN_S, Settled, Settler, publish
from ckptd.core.store.pagehash import HASH_SIZE
from ckptd.core.undo import InDoubt, RestoreHere, UndoLog
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    DumpRequest,
    EventKind,
    MigrateOutcome,
    MigrateRequest,
    PeerProbe,
    ReceivedState,
    RemoteRestore,
    RestoreOutcome,
    RestoreRequest,
)
from ckptd.errors import CkptdError, Incompatible, InvalidTarget, PeerError

log = logging.getLogger(__name__)

OFFER_PAGES = 1 << 20
"""Page references per offer message (16 MiB): any image size fits the message limit."""
RUN_BYTES = 16
"""What a frame's place run costs on the wire (four 32-bit numbers)."""



class Dumper(Protocol):
    """``CheckpointService.dump``: ``gate`` is called with the checkpoint id before commit."""

    def __call__(
        self, caller: Caller, request: DumpRequest, progress: ProgressSink,
        gate: Callable[[str], None] | None = None, /,
    ) -> CheckpointRecord: ...


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
    preview: CheckpointRecord | None = None
    """The record a dump would make, taken before the target is contacted (local refusals)."""
    probe: PeerProbe | None = None
    record: CheckpointRecord | None = None
    session: PeerSession | None = None
    remote: RemoteRestore | None = None
    in_doubt: bool = False
    """The link broke while the target was restoring and it did not say whether it restored
    the tree: it may be running there."""
    not_there: tuple[InDoubt, ReceivedState] | None = None
    """The link broke while the target was restoring, and it said it never restored it."""
    restored_here: RestoreOutcome | None = None
    pages_total: int = 0
    pages_sent: int = 0
    bytes_sent: int = 0
    transfer_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per step, for the log."""
    notes: list[str] = field(default_factory=list)
    undo_log: UndoLog | None = None
    """The migration's durable undo records (with a journal)."""


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
        events: EventBus | None = None,
        journal: Journal | None = None,
        settle_within_s: float = SETTLE_WITHIN_S,
    ) -> None:
        self._journal = journal
        self.settler = Settler(connector=connector, restore_here=restore_here, clock=clock,
                               journal=journal, events=events, within_s=settle_within_s)
        self._events = events
        self._preview = preview
        self._dump = dump
        self._back_here = BackHere(restore_here)
        self._pages = pages
        self._connector = connector
        self._clock = clock
        self.steps: tuple[Step[MigrateContext], ...] = tuple(
            Step(name, self._timed(name, do), undo, describe) for name, do, undo, describe in (
                ("connect", self._connect, self._disconnect, "connecting to the target daemon"),
                ("probe", self._probe, None, "asking the target whether it can restore"),
                ("dump", self._dump_here, self._restore_back, "checkpointing the tree here"),
                ("open", self._open, self._abort, "opening the transfer"),
                ("send", self._send, None, "sending the pages the target lacks"),
                ("finish", self._finish, None, "the target commits and restores"),
            )
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
        if self._journal is not None:
            ctx.undo_log = UndoLog(self._journal, f"m-{secrets.token_hex(6)}", "migrate")
        try:
            # the local refusals (pid 1, no such pid, not the caller's) before the target is
            # contacted: an unreachable or slow peer never delays them
            ctx.preview = self._preview(caller, self._dump_request(ctx))
            run_steps(self.steps, ctx, progress, ctx.undo_log)
        except Exception as exc:
            if ctx.undo_log is not None and not ctx.in_doubt:
                ctx.undo_log.end()  # rolled back (a dying daemon never gets here)
            if not isinstance(exc, CkptdError):
                raise
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
        if ctx.undo_log is not None:
            ctx.undo_log.end()
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
        log.info(
            "migrated %s to %s: down %.2fs (%s); %d of %d pages, %d bytes sent",
            outcome.checkpoint_id, request.to, outcome.downtime_s,
            ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()),
            outcome.pages_sent, outcome.pages_total, outcome.bytes_sent,
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
        if ctx.preview is None:
            ctx.preview = self._preview(ctx.caller, self._dump_request(ctx))
        ctx.probe = ctx.link.probe(ctx.preview)
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
        log_ = ctx.undo_log
        if log_ is None:
            ctx.record = self._dump(ctx.caller, self._dump_request(ctx), ctx.progress)
            return

        def before_commit(checkpoint_id: str) -> None:
            """Durable before the dump commits (and so before it kills the tree)."""
            log_.checkpoint_id = checkpoint_id
            log_.record("dump", RestoreHere(checkpoint_id, ctx.caller.uid, ctx.request.to))

        ctx.record = self._dump(ctx.caller, self._dump_request(ctx), ctx.progress,
                                before_commit)

    def _restore_back(self, ctx: MigrateContext) -> None:
        """dump's undo: what its record says (RestoreHere, or InDoubt once ``finish`` began
        and the link broke), through ``core.rollback.BackHere`` as a restart does it."""
        if ctx.record is None:
            return  # the dump failed: its own rollback left the tree running
        if ctx.in_doubt:
            ctx.notes.append(
                f"the link broke while {ctx.request.to} was restoring, and it did not answer "
                f"within {self.settler.within_s:.0f}s whether it restored pid {ctx.record.pid}: "
                "the checkpoint is kept, and this daemon asks again at its next start "
                "(restoring it here only if it was not restored there)")
            return
        ctx.restored_here, note = self._back_here.restore(
            RestoreHere(ctx.record.id, ctx.caller.uid, ctx.request.to), ctx.caller)
        ctx.notes.append(note)
        if ctx.not_there is not None:
            doubt, state = ctx.not_there
            publish(self._events, doubt, Settled(
                "source" if ctx.restored_here is not None else "neither",
                f"{state.node or doubt.to} never restored it; {note}", state, ctx.restored_here))

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
        with self._pages.export(ctx.record.id, session.page_seed) as export:
            wanted: dict[str, list[int]] = {}
            for image in export.images:
                if image.refs is None:
                    session.offer_file(image.name, image.data, image.size)
                    ctx.bytes_sent += len(image.data)
                    continue
                ctx.pages_total += image.pages
                missing: list[int] = []
                count = len(image.refs) // HASH_SIZE
                for first in range(0, max(count, 1), OFFER_PAGES):
                    chunk = image.refs[first * HASH_SIZE : (first + OFFER_PAGES) * HASH_SIZE]
                    missing += session.offer_pages(image.name, image.size, chunk, first)
                    ctx.bytes_sent += len(chunk)
                if missing:
                    wanted[image.name] = missing
            counted = _Counting(export.frames(wanted))
            ctx.pages_sent = session.send(iter(counted))
            ctx.bytes_sent += counted.bytes
        ctx.transfer_s = self._clock.monotonic() - started

    def _finish(self, ctx: MigrateContext) -> None:
        assert ctx.session is not None and ctx.record is not None
        doubt = InDoubt(ctx.record.id, ctx.request.to, ctx.caller.uid, self._clock.time())
        if ctx.undo_log is not None:  # from now on the target may run it: never twice
            ctx.undo_log.record("dump", doubt)
        try:
            ctx.remote = ctx.session.finish(ctx.request.output_path)
        except PeerError as exc:
            if not exc.in_doubt:
                raise
            state = self.settler.ask(doubt)  # until it answers (bounded)
            if state is None:
                ctx.in_doubt = True
                raise
            if not state.restored:  # and never will: the dump's undo restores it here
                ctx.not_there = (doubt, state)
                exc.message = (f"{exc.message}; asked after that, {state.node or doubt.to} "
                               "said it never restored it")
                raise
            ctx.remote = RemoteRestore(ctx.record.id, state.pid, state.output_path,
                                       state.node)
            log.warning("migration of %s: the link broke while %s restored it; asked, it said "
                        "it runs there as pid %d", ctx.record.id, doubt.to, state.pid)
            publish(self._events, doubt, Settled("target", f"{state.node} restored it as "
                                                 f"pid {state.pid}", state))

    # ---- helpers ----------------------------------------------------------------------------

    def _timed(
        self, name: str, do: Callable[[MigrateContext], None]
    ) -> Callable[[MigrateContext], None]:
        def timed(ctx: MigrateContext) -> None:
            started = self._clock.monotonic()
            try:
                do(ctx)
            finally:
                ctx.timings[name] = self._clock.monotonic() - started

        return timed

    def _dump_request(self, ctx: MigrateContext) -> DumpRequest:
        return DumpRequest(
            pid=ctx.request.pid, leave_running=False, name=ctx.request.name,
            labels=dict(ctx.request.labels),
        )


class _Counting:
    """Counts the bytes of the frames that go through it (data, places, image names)."""

    def __init__(self, frames: Iterator[PageFrame]) -> None:
        self._frames = frames
        self.bytes = 0

    def __iter__(self) -> Iterator[PageFrame]:
        for frame in self._frames:
            names = {run[0] for run in frame.runs}
            self.bytes += len(frame.data) + RUN_BYTES * len(frame.runs) + sum(map(len, names))
            yield frame
