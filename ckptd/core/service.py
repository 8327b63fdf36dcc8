"""CheckpointService: the daemon's operations, as the transports see them.

It adds to the recipes what every operation needs: caller checks for reads, one operation per
pid at a time (PidLocks), operation ids, and recovery of operations a killed daemon left in
flight. It knows nothing of gRPC: transports translate to and from it.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import logging
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from ckptd.core.callers import caller_gone, caller_process
from ckptd.core.config import CoreConfig
from ckptd.core.dump import DumpRecipe
from ckptd.core.events import EventBus
from ckptd.core.gpu import GpuSteps
from ckptd.core.locks import PidLocks
from ckptd.core.ports import Cgroups, CheckpointStore, Clock, Journal, ProcessTable
from ckptd.core.ports.asides import AsideRecord
from ckptd.core.recipe import ProgressSink, no_progress
from ckptd.core.restore import RestoreRecipe
from ckptd.core.targets import container_job, container_of_cgroup
from ckptd.core.undo import (
    BadEntry,
    Entry,
    InDoubt,
    Received,
    decode_entry,
    received_op_id,
)
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CompatReport,
    DumpRequest,
    EventKind,
    GcReport,
    NodeReport,
    Progress,
    RestoreOutcome,
    RestoreRequest,
    VerifyReport,
)
from ckptd.domain.model import ROOT
from ckptd.errors import (
    Cancelled,
    CgroupUnavailable,
    CkptdError,
    CorruptCheckpoint,
    InvalidTarget,
    PermissionDenied,
    ProcessNotFound,
)

log = logging.getLogger(__name__)

RECEIVED_KEEP_S = 30 * 86400.0
"""How long a migration target keeps what it did with a checkpoint it was sent (its answer
to a source asking after a broken link); a source stops asking about a migration older than
``core.settle.SETTLE_MAX_AGE_S``, far less."""

RETENTION_GC_MIN_S = 60.0
"""The shortest time between two collections that retention asks for
(``collect_after_retention``): a job checkpointed every 10 s with ``--keep`` gets the data
its deleted checkpoints held condemned (and, past ``gc_grace_s``, deleted) within about a
minute, not at the next ``gc_interval_s``, and GC's exclusive lock is taken at most once a
minute for it."""


class CheckpointService:
    def __init__(
        self,
        *,
        dump: DumpRecipe,
        restore: RestoreRecipe,
        store: CheckpointStore,
        processes: ProcessTable,
        journal: Journal,
        clock: Clock,
        config: CoreConfig,
        probe: Callable[[], NodeReport],
        gpu: GpuSteps | None = None,
        events: EventBus | None = None,
        cgroups: Cgroups | None = None,
    ) -> None:
        self._cgroups = cgroups
        self._gpu = gpu
        self.events = events or EventBus(clock)
        self._clock = clock
        self._dump = dump
        self._restore = restore
        self._store = store
        self._processes = processes
        self._journal = journal
        self._config = config
        self._probe = probe
        self._locks = PidLocks()
        self._in_flight: collections.Counter[str] = collections.Counter()
        """Operations in flight (a lazy restore's twice: its restore, and its pages until all
        are in)."""
        self._in_flight_lock = threading.Condition()
        self._closing = False
        self._undoer = restore.parts.undoer(restore_here=self._restore_here)
        self.unsettled: builtins.list[tuple[str, InDoubt]] = []
        """Migrations in doubt that ``recover`` left journaled, for ``core.settle``."""
        self._retention_deleted = False
        """Retention deleted a checkpoint since the last collection began."""
        self._last_gc_at: float | None = None
        """When the last collection began (``clock.monotonic``); None: none yet."""
        self._gc_due_lock = threading.Lock()

    # ---- operations -------------------------------------------------------------------------

    def dump(
        self,
        caller: Caller,
        request: DumpRequest,
        progress: ProgressSink = no_progress,
        gate: Callable[[str], None] | None = None,
    ) -> CheckpointRecord:
        """``gate``: see ``DumpContext.gate`` (group checkpoints). A container given by its
        init's pid or its cgroup names the job under that init (``targets.container_job``)."""
        request = self._container_target(request)
        self._refuse_if_closing(request.pid)
        with self._locks.hold(request.pid, "a checkpoint"):
            ctx = self._dump.new_context(caller, request)
            ctx.gate = gate
            ck, name = ctx.checkpoint_id, request.name
            owner = caller.uid if not caller.is_root else self._processes.status(
                request.pid).uid
            self.events.publish(EventKind.CHECKPOINT_STARTED, pid=request.pid, checkpoint_id=ck,
                                name=name, uid=owner,
                                message=f"checkpoint of pid {request.pid} started",
                                leave_running=request.leave_running)

            def sink(p: Progress) -> None:
                progress(p)
                self.events.publish(EventKind.CHECKPOINT_PROGRESS, pid=request.pid,
                                    checkpoint_id=ck, name=name, uid=owner, message=p.message,
                                    stage=p.stage, fraction=p.fraction)

            with self._operation(ctx.checkpoint_id):
                try:
                    record = self._dump.run(ctx, sink)
                except Exception as exc:
                    self.events.publish(EventKind.CHECKPOINT_FAILED, pid=request.pid,
                                        checkpoint_id=ck, name=name, uid=owner, message=str(exc),
                                        error=type(exc).__name__)
                    raise
        self.events.publish(
            EventKind.CHECKPOINT_COMMITTED, pid=record.pid, checkpoint_id=record.id,
            name=record.name, uid=record.uid,
            message=f"checkpoint of pid {record.pid} committed ({record.bytes_new} new bytes)",
            **checkpoint_figures(record),
        )
        if request.keep > 0 and request.name:
            for old in self._beyond_retention(request.keep, request.name, record.uid):
                with contextlib.suppress(CkptdError):
                    self._store.delete(old)
                    self._retention_deleted = True
                    log.info("retention: deleted %s (keep %d of %r)", old, request.keep,
                             request.name)
        self._prune_work_dirs()
        log.info(
            "dumped pid %d as %s (%d bytes, frozen %.3fs)",
            record.pid, record.id, record.bytes, record.frozen_s,
        )
        return record

    def restore(
        self,
        caller: Caller,
        request: RestoreRequest,
        progress: ProgressSink = no_progress,
        gate: Callable[[int], None] | None = None,
        staged: tuple[CheckpointRecord, Path] | None = None,
        received: Received | None = None,
    ) -> RestoreOutcome:
        """``gate``: see ``RestoreContext.gate`` (group restores). ``staged``: restore this
        record from these images, verified but not yet committed (a migration's target, which
        commits them once the tree runs). ``received``: a migration target's restore, whose
        journal entry (``received_op_id``) ends into that record once the tree runs."""
        op_id = (received_op_id(received.checkpoint_id) if received is not None
                 else f"r{secrets.token_hex(4)}")
        ctx = self._restore.new_context(caller, request, op_id)
        if received is not None and ctx.undo_log is not None:
            ctx.undo_log.kept = received.facts()
        if staged is not None:
            ctx.record, ctx.images_dir = staged
        record = self._restore.resolve(ctx)
        ctx.gate = gate
        ctx.events = self.events
        self.events.publish(EventKind.RESTORE_STARTED, pid=record.pid, checkpoint_id=record.id,
                            name=record.name, uid=record.uid,
                            message=f"restore of {record.id} started")
        started = self._clock.monotonic()
        with self._locks.hold(record.pid, "a restore"), self._operation(ctx.op_id):
            try:
                outcome = self._restore.run(ctx, progress)
                if ctx.lazy is not None:  # in flight until every page is in (wait_idle)
                    self._begin(ctx.op_id)
                    ctx.lazy.when_ended(functools.partial(self._end, ctx.op_id))
            except Exception as exc:
                self.events.publish(EventKind.RESTORE_FAILED, pid=record.pid,
                                    checkpoint_id=record.id, name=record.name, uid=record.uid,
                                    message=str(exc), error=type(exc).__name__)
                raise
        self.events.publish(EventKind.RESTORE_DONE, pid=outcome.pid, checkpoint_id=record.id,
                            name=record.name, uid=record.uid,
                            message=f"restored as pid {outcome.pid}" + _files_note(outcome)
                            + (f"; {outcome.tcp_closed}" if outcome.tcp_closed else "")
                            + (f" in cgroup {outcome.cgroup}" if outcome.cgroup else ""),
                            duration_s=self._clock.monotonic() - started,
                            cgroup=outcome.cgroup)
        self._prune_work_dirs()
        log.info("restored %s as pid %d%s", outcome.checkpoint_id, outcome.pid,
                 f" in cgroup {outcome.cgroup}" if outcome.cgroup else "")
        return outcome

    def _container_target(self, request: DumpRequest) -> DumpRequest:
        pid = request.pid
        if request.cgroup:
            if pid:
                raise InvalidTarget("give a pid or a cgroup, not both")
            if self._cgroups is None:
                raise CgroupUnavailable(
                    f"cannot find the container of cgroup {request.cgroup}: this daemon has "
                    "no cgroup v2 hierarchy", hint="give the job's pid")
            pid = container_of_cgroup(self._processes, request.cgroup,
                                      self._cgroups.procs(request.cgroup))
        job = container_job(self._processes, pid) if pid > 0 else 0
        if job:
            log.info("pid %d is a container's init: checkpointing its job, pid %d", pid, job)
        return replace(request, pid=job or pid, cgroup="")

    def list(self, caller: Caller, pid: int = 0, name: str = "") -> list[CheckpointRecord]:
        return [
            r
            for r in self._store.list()
            if (caller.is_root or r.uid == caller.uid)
            and (not pid or r.pid == pid)
            and (not name or r.name == name)
        ]

    def asides(self, caller: Caller, checkpoint_id: str = "") -> builtins.list[AsideRecord]:
        """The copies restores kept aside, as recorded: of the caller's checkpoints (every
        one for root), of ``checkpoint_id``'s restores only when given; oldest first."""
        log = self._restore.parts.asides
        if log is None:
            return []
        return [r for r in log.records()
                if (caller.is_root or r.owner == caller.uid)
                and (not checkpoint_id or r.checkpoint_id == checkpoint_id)]

    def get(self, caller: Caller, checkpoint_id: str) -> CheckpointRecord:
        record = self._store.get(checkpoint_id)
        self._check_owner(caller, record)
        return record

    def check_restore(self, caller: Caller, checkpoint_id: str) -> CompatReport:
        """Whether this node can restore ``checkpoint_id``: every blocking difference and
        every warning (what a restore would refuse with)."""
        record = self.get(caller, checkpoint_id)
        return self._restore.check(record, caller=caller)

    def delete(self, caller: Caller, checkpoint_id: str) -> None:
        record = self._store.get(checkpoint_id)
        self._check_owner(caller, record)
        with self._locks.hold(record.pid, "a restore or dump of that process"):
            self._store.delete(checkpoint_id)

    def check(self) -> NodeReport:
        return self._probe()

    def reserve_pids(self, caller: Caller, above: int) -> int:
        """The caller's pid namespace (a container's) hands out pids above ``above`` from now
        on (``ckptctl run`` asks before it starts its job, so that the job's pids stay free in
        the next container, whose own processes take low ones). Returns the namespace's
        counter; 0 when the caller shares the daemon's pid namespace (nothing to do)."""
        if caller.pid is None or caller.pid <= 0:
            raise InvalidTarget("the daemon cannot tell the caller's process",
                                hint="call it over the Unix socket (SO_PEERCRED)")
        if not 0 < above < 1 << 22:
            raise InvalidTarget(f"cannot reserve pids up to {above}",
                                hint="give a number between 1 and 4194303")
        before = "its pid namespace's pids could be reserved"
        with caller_process(self._processes, caller, before) as pid:
            try:
                return self._processes.reserve_pids(pid, above, start_time=caller.start_time)
            except ProcessNotFound as exc:  # it exited meanwhile; its pid may be another's
                raise caller_gone(caller, before) from exc

    def verify(self, caller: Caller, checkpoint_id: str = "") -> VerifyReport:
        """One checkpoint (its owner or root), or the whole store (root only). Root gets a
        report also for a checkpoint whose manifest is damaged (its owner is unknown then)."""
        if checkpoint_id:
            try:
                record = self._store.get(checkpoint_id)
            except CorruptCheckpoint:
                if not caller.is_root:
                    raise
            else:
                self._check_owner(caller, record)
        elif not caller.is_root:
            raise PermissionDenied(
                "only root may verify the whole store", hint="name one of your checkpoints"
            )
        return self._store.verify(checkpoint_id)

    def gc(self, caller: Caller, keep_last: int = 0, name: str = "", *,
           compact: bool = True) -> GcReport:
        """Apply retention (``keep_last`` newest per name, or of ``name``), then collect what
        no checkpoint needs, and (``compact``) rewrite what is mostly garbage. Root only: it
        touches every user's data."""
        if not caller.is_root:
            raise PermissionDenied("only root may collect garbage")
        # what retention deletes from now on is this run's or the next one's (a deletion
        # racing this line is collected by the next: never by none)
        self._retention_deleted = False
        self._last_gc_at = self._clock.monotonic()
        doomed = self._beyond_retention(keep_last, name) if keep_last > 0 else ()
        report = self._store.collect_garbage(doomed, compact=compact)
        self.events.publish(EventKind.GC_DONE, message="garbage collected",
                            bytes_freed=report.bytes_freed,
                            checkpoints_deleted=len(report.deleted_checkpoints))
        log.info(
            "gc: deleted %d checkpoint(s), %d pack(s), %d blob(s), %d bytes freed",
            len(report.deleted_checkpoints), report.packs_deleted, report.blobs_deleted,
            report.bytes_freed,
        )
        for line in report.skipped:
            log.warning("gc: %s", line)
        return report

    def collect_after_retention(self, min_interval_s: float = RETENTION_GC_MIN_S,
                                ) -> GcReport | None:
        """Collect now (as the periodic GC does) if retention deleted a checkpoint since the
        last collection began and that began at least ``min_interval_s`` ago; else None.
        The daemon calls it every few seconds: what ``--keep`` drops is collected soon, not
        at the next ``gc_interval_s``. One collection at a time by this path."""
        with self._gc_due_lock:
            now = self._clock.monotonic()
            if not self._retention_deleted or (
                    self._last_gc_at is not None and now - self._last_gc_at < min_interval_s):
                return None
            return self.gc(ROOT)

    def _beyond_retention(self, keep_last: int, name: str = "",
                          owner: int | None = None) -> tuple[str, ...]:
        """Checkpoint ids beyond the ``keep_last`` newest of each name (or of ``name``) of
        each owner (or of ``owner``): a name is its owner's (issue 21), one user's retention
        never deletes another's checkpoints. Unnamed checkpoints are never selected."""
        by_name: dict[tuple[int, str], builtins.list[str]] = {}
        for record in self._store.list():
            if (record.name and (not name or record.name == name)
                    and (owner is None or record.uid == owner)):
                by_name.setdefault((record.uid, record.name), []).append(record.id)
        doomed: builtins.list[str] = []
        for ids in by_name.values():
            doomed.extend(ids[: max(0, len(ids) - keep_last)])
        return tuple(doomed)

    # ---- start-up -------------------------------------------------------------------------

    def recover(self) -> builtins.list[str]:
        """Finish or undo what a killed daemon left in flight: each operation's journaled
        undo records (``core.undo``) run newest first through ``core.rollback.Undoer``, the
        code the recipes roll back with. Dumps and restores first, migrations last (a
        migration restores its tree here only once its dump's own entry was dealt with).
        A migration in doubt (the link broke while its target restored) stays journaled, in
        ``unsettled``: its target is asked after the start (``core.settle``). A migration
        target's ``Received`` records stay (those older than ``RECEIVED_KEEP_S`` go). An entry
        that cannot be read is logged and forgotten. Returns what was done."""
        done: builtins.list[str] = []
        entries: builtins.list[tuple[str, Entry]] = []
        for op_id, facts in list(self._journal.pending()):
            received = Received.from_facts(facts)
            if received is not None:
                if self._clock.time() - received.time > RECEIVED_KEEP_S:
                    self._journal.end(op_id)
                continue
            try:
                entries.append((op_id, decode_entry(facts)))
            except BadEntry as exc:
                log.error("recovery: journal entry %s cannot be read, forgotten: %s", op_id, exc)
                self._journal.end(op_id)
        entries.sort(key=lambda e: e[1].op == "migrate")
        for op_id, entry in entries:
            doubt = entry.undos[-1] if entry.op == "migrate" and entry.undos else None
            if isinstance(doubt, InDoubt) and doubt.uid >= 0:
                self.unsettled.append((op_id, doubt))
                done.append(f"migration of {doubt.checkpoint_id} to {doubt.to} in doubt: "
                            "its target is asked whether it restored it")
                continue
            line = self._undoer.replay(entry)
            if line:
                done.append(line)
            self._journal.end(op_id)
        for line in done:
            log.warning("recovery: %s", line)
        return done

    def _restore_here(self, caller: Caller, request: RestoreRequest) -> RestoreOutcome:
        return self.restore(caller, request)

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _check_owner(caller: Caller, record: CheckpointRecord) -> None:
        if not caller.is_root and record.uid != caller.uid:
            raise PermissionDenied(
                f"checkpoint {record.id} belongs to uid {record.uid}, the caller is uid "
                f"{caller.uid}",
                checkpoint_id=record.id,
            )

    def close(self) -> None:
        """The daemon is stopping: refuse new dumps (a dump cut by the exit would leave its
        tree stopped); running ones finish. Restores stay allowed: a failed migration's
        rollback must still bring its job back."""
        with self._in_flight_lock:
            self._closing = True

    def _refuse_if_closing(self, pid: int) -> None:
        if self._closing:
            raise Cancelled("the daemon is stopping: no new checkpoint", pid=pid)

    def operation(self, op_id: str) -> contextlib.AbstractContextManager[None]:
        """Mark a longer operation in flight (a migration: dump, send, finish) so that a
        stopping daemon waits for it."""
        return self._operation(op_id)

    @contextlib.contextmanager
    def _operation(self, op_id: str) -> Iterator[None]:
        """Marks ``op_id`` in flight: its work directory is never pruned meanwhile."""
        self._begin(op_id)
        try:
            yield
        finally:
            self._end(op_id)

    def _begin(self, op_id: str) -> None:
        with self._in_flight_lock:
            self._in_flight[op_id] += 1

    def _end(self, op_id: str) -> None:
        with self._in_flight_lock:
            self._in_flight[op_id] -= 1
            if self._in_flight[op_id] <= 0:
                del self._in_flight[op_id]
            self._in_flight_lock.notify_all()

    def wait_idle(self, timeout: float) -> builtins.list[str]:
        """Wait until no dump or restore runs (a daemon stopping must not cut one short: a
        dump left half-way would leave its tree stopped until the next start). Returns the
        operations still running after ``timeout`` seconds."""
        with self._in_flight_lock:
            self._in_flight_lock.wait_for(lambda: not self._in_flight, timeout=timeout)
            return sorted(self._in_flight)

    def _prune_work_dirs(self) -> None:
        """Keep the CRIU logs of the last few finished operations only."""
        root = self._config.work_dir
        with self._in_flight_lock:
            busy = set(self._in_flight)
        dirs = []
        with contextlib.suppress(FileNotFoundError):
            for path in root.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if path.name not in busy:
                        dirs.append((path.stat().st_mtime, path))
        dirs.sort()
        for _, old in dirs[: max(0, len(dirs) - self._config.keep_work_dirs)]:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_figures(record: CheckpointRecord) -> dict[str, float]:
    """The figures of a committed checkpoint that events and metrics carry."""
    figures: dict[str, float] = {
        "bytes": record.bytes,
        "bytes_logical": record.bytes_logical,
        "bytes_new": record.bytes_new,
        "frozen_s": record.frozen_s,
        "duration_s": record.duration_s,
        "dedup_ratio": record.bytes_logical / record.bytes if record.bytes else 0.0,
    }
    if record.gpu is not None:
        figures["gpu_lock_s"] = record.gpu.lock_s
        figures["gpu_checkpoint_s"] = record.gpu.checkpoint_s
    return figures


def _files_note(outcome: RestoreOutcome) -> str:
    """What a restore did to files, for its event: each file put back, each copy kept,
    each left as found under a writer outside the tree."""
    if not outcome.files_put_back and not outcome.files_left:
        return ""
    note = f"; put back {', '.join(outcome.files_put_back)}" if outcome.files_put_back else ""
    if outcome.files_kept:
        note += f" (versions found kept as {', '.join(outcome.files_kept)})"
    if outcome.files_left:
        note += (f"; left as found, written by a process outside the checkpoint "
                 f"(shared_files = keep): {', '.join(outcome.files_left)}")
    return note
