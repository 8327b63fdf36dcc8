"""The dump recipe: the one place that says how a process tree becomes a checkpoint.

Order, and what undoes each step if a later one fails:

    inspect         the tree, its stdio, stopped processes, CUDA processes,    -
                    the node fingerprint (node facts, files the tree uses)
    journal         durable "dump in flight" record (a restarted daemon undoes it)  end the record
                    and the guard's watch (a guard outside the daemon acts at once
                    on the tree if the daemon dies: core.guard)
    stage           an empty image directory in the store                     abort it
    precopy         copy what the tree's append-only files (logs) hold, while  -
                    it runs: the freeze copies only what they gain meanwhile
    gpu-lock        lock every CUDA process (before CRIU seizes any)           restore + unlock
    gpu-checkpoint  move device memory into host memory                       (gpu-lock's undo)
    criu-dump       CRIU dumps the tree and holds it frozen at its post-dump   CRIU resumes it and
                    point (images complete, network locked)                    unlocks its network
    files           capture the content of every file the tree writes          -
                    (``core.jobfiles``), the tree still frozen (append-only
                    files: their new tail, see precopy)
    let-go          CRIU ends: leave-running, the tree runs on — a CUDA tree  (criu-dump's undo
                    is stopped first (SIGSTOP queued while CRIU still holds    SIGCONTs it)
                    it: delivered as CRIU detaches, before any of its code
                    runs), to run only once its CUDA is back (docs/adr/0019);
                    else it stays stopped (not with TCP connections: see
                    criu-finish)
    gate            group checkpoints only: hold here (tree frozen or, with    -
                    leave-running, running unless CUDA; images staged) until
                    the group commits, or raise to abort
    commit          the checkpoint becomes durable, then visible (the guard   delete it
                    is told before and after: ``GuardPhase``)
    gpu-resume      leave-running: CUDA restore + unlock, only now, each CUDA  -
                    process held but its restore thread; then the tree is let
                    go (SIGCONT), whether or not CUDA came back: a resume that
                    fails keeps the committed checkpoint (the dump then raises
                    saying so, and its journal entry stays for the next start
                    to retry the resume: ResumeCuda)
    criu-finish     a tree with TCP connections: CRIU ends only now, leaving  -
                    it stopped with its connections locked
    release         leave-running: nothing; else kill the tree                -

Durable undos (``core.undo``, written before the step's effect can exist; a restarted daemon
replays them newest first, ``CheckpointService.recover``): stage: AbortStaging; gpu-lock:
ResumeCuda (unless committed, for a killing dump); criu-dump: ResumeTree (unless committed,
for a killing dump; re-recorded with the pids CRIU froze); commit, killing dumps: KillTree if
committed. Recovery runs ResumeCuda with the tree still stopped, then ResumeTree. So a
daemon killed at any point leaves, after its restart, the tree killed once its checkpoint
is committed (docs/adr/0002), else running with nothing listed and nothing staged; except
that a guard that resumed the tree while the commit was under way appends GuardResumed:
the checkpoint goes, the tree runs on (docs/adr/0016). A CUDA undo that fails (in the
rollback, or leave-running's resume after the commit) leaves the journal entry in place, so
the next start runs ResumeCuda again (issue 23).

Invariants: the target is never left frozen or stopped by a failed dump: CRIU leaves a tree
stopped, not killed, so a failed commit can still resume it; a tree with established TCP
connections (in repair mode, its network locked) cannot be resumed by a signal once CRIU is
done, so CRIU holds it until the commit and a failure has CRIU resume it, connections out of
repair and network unlocked. A checkpoint is listed only once committed; the tree is killed
only after its checkpoint is durable. Every process the recipe
signals is held (``core.held``) from when it was identified: pids in CRIU's images are the
tree's own namespace's, mapped through /proc, never signalled as they are.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.core import ghosts, gpumemory, jobfiles
from ckptd.core.gpu import GpuSession
from ckptd.core.guard import NoGuard
from ckptd.core.held import HeldTree, map_image_pids
from ckptd.core.parts import RecipeParts
from ckptd.core.ports import (
    CriuDumpInProgress,
    CriuDumpJob,
    CriuDumpResult,
    CriuPlacement,
    GuardPhase,
    Precopy,
    SharedFile,
    TreeGuard,
    WrittenFile,
)
from ckptd.core.ports.criu import RELINKS_IMAGE, CriuRelink, encode_relinks
from ckptd.core.ports.files import JobFiles
from ckptd.core.recipe import ProgressSink, Step, run_steps
from ckptd.core.targets import check_dump_target, check_tcp, container_init
from ckptd.core.undo import AbortStaging, KillTree, ResumeCuda, ResumeTree, Undo, UndoLog
from ckptd.domain import (
    Caller,
    CapturedFile,
    CheckpointRecord,
    DumpRequest,
    NodeFingerprint,
    PidState,
    ProcessFact,
    StdioFact,
    TcpConnection,
    new_checkpoint_id,
)
from ckptd.errors import (
    CkptdError,
    CriuFailed,
    CriuUnavailable,
    GpuFailed,
    PermissionDenied,
    ProcessNotFound,
)

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long a killing dump waits for its SIGKILLed tree to die."""


@dataclass
class DumpContext:
    caller: Caller
    request: DumpRequest
    checkpoint_id: str
    started: float
    tree: tuple[ProcessFact, ...] = ()
    stdio: tuple[StdioFact, ...] = ()
    stopped_before: frozenset[int] = frozenset()
    images_dir: Path | None = None
    work_dir: Path | None = None
    criu: CriuDumpInProgress | None = None
    """CRIU's dump, held at post-dump until ``let-go`` or ``criu-finish`` (or aborted)."""
    criu_result: CriuDumpResult | None = None
    criu_s: float = 0.0
    """How long CRIU took to reach post-dump (the tree frozen all along)."""
    record: CheckpointRecord | None = None
    gpu: GpuSession = field(default_factory=GpuSession)
    fingerprint: NodeFingerprint | None = None
    notes: list[str] = field(default_factory=list)
    lost_locks: list[str] = field(default_factory=list)
    """The file locks a restore will not take back (``Criu.lost_locks``): recorded with the
    files not captured."""
    gate: Callable[[str], None] | None = None
    """Group checkpoints: called with the checkpoint id once the tree is dumped and before
    anything is committed; returns to commit, raises to abort (the tree is resumed)."""
    held: HeldTree | None = None
    """The tree's processes, held since ``inspect`` (and those CRIU found later)."""
    files: tuple[CapturedFile, ...] = ()
    files_skipped: tuple[str, ...] = ()
    relinks: tuple[CriuRelink, ...] = ()
    """CRIU's link-remap files of the images, each with the name it is linked as (``files``
    records them with the images; a dump that kills removes them once CRIU is done)."""
    relinks_in: JobFiles | None = None
    """The files port (the tree's root) they were found through."""
    written: tuple[WrittenFile, ...] = ()
    """The files the tree writes, as ``inspect`` listed them (re-listed while frozen)."""
    precopies: dict[str, Precopy] = field(default_factory=dict)
    shared: dict[str, SharedFile] = field(default_factory=dict)
    """Of ``written``, those processes outside the tree write too (found at ``inspect``)."""
    ghost_bytes: int = 0
    """The ghost files' bytes the dump takes (``core.ghosts``; staged with the images)."""
    tcp_connections: int = 0
    """TCP sockets with a peer (any state) of the tree at ``inspect`` (CRIU dumps them
    established); once CRIU has dumped, the connections its images hold (``tcp``)."""
    tcp: tuple[TcpConnection, ...] = ()
    """The TCP connections CRIU's images hold (what a restore must bring back)."""
    container: CriuPlacement | None = None
    """A container job: CRIU runs inside the container (its init's namespaces, cgroups)."""
    undo_log: UndoLog | None = None
    """The dump's durable undo records (journal entry ``checkpoint_id``)."""
    stopped_for_cuda: tuple[int, ...] = ()
    """Leave-running, CUDA: the processes ``let-go`` stopped, continued once CUDA is back."""
    cuda_resume_error: BaseException | None = None
    """Bringing CUDA back to RUNNING failed (rollback, or leave-running's resume after the
    commit): the journal entry is kept for the next start (its ResumeCuda)."""


class DumpRecipe:
    """Checkpoints one process tree. Thread-safe: callers serialize per pid (PidLocks)."""

    def __init__(self, parts: RecipeParts, *, guard: TreeGuard | None = None) -> None:
        self.parts = parts
        self._cgroups = parts.cgroups
        self._guard: TreeGuard = guard or NoGuard()
        self._gpu = parts.gpu
        self._node = parts.node
        self._files = parts.files
        self._criu = parts.criu
        self._processes = parts.processes
        self._store = parts.store
        self._journal = parts.journal
        self._clock = parts.clock
        self._config = parts.config
        self._hooks = parts.hooks
        self.ghost_budget = ghosts.GhostBudget()
        self.undoer = parts.undoer()
        self.steps: tuple[Step[DumpContext], ...] = (
            Step("inspect", self._inspect, None, "inspecting the process tree"),
            Step("journal", self._journal_begin, self._journal_end, "recording the operation"),
            Step("stage", self._stage, self._unstage, "preparing the image directory",
                 durable=lambda ctx: AbortStaging(ctx.checkpoint_id)),
            Step("precopy", self._precopy_files, None, "copying the logs the tree appends to"),
            Step("gpu-lock", self._gpu_lock, self._gpu_resume, "locking CUDA processes",
                 durable=self._resume_cuda_record),
            Step("gpu-checkpoint", self._gpu_checkpoint, None, "moving GPU memory to the host"),
            Step("criu-dump", self._criu_dump, self._abort_criu, "CRIU is dumping the tree",
                 durable=self._resume_tree_record),
            Step("files", self._capture_files, None, "capturing the files the tree writes"),
            Step("let-go", self._let_go, None, "letting CRIU finish"),
            Step("gate", self._gate, None, "waiting for every member of the group"),
            Step("commit", self._commit, self._uncommit, "committing the checkpoint",
                 durable=self._kill_tree_record),
            Step("gpu-resume", self._gpu_resume_if_running, None, "resuming CUDA"),
            Step("criu-finish", self._finish_criu, None, "letting CRIU finish"),
            Step("release", self._release, None, "releasing the tree"),
        )

    def new_context(self, caller: Caller, request: DumpRequest) -> DumpContext:
        now = self._clock.time()
        ckpt = new_checkpoint_id(now)
        return DumpContext(caller, request, ckpt, now,
                           undo_log=UndoLog(self._journal, ckpt, "dump", ckpt))

    def run(self, ctx: DumpContext, progress: ProgressSink) -> CheckpointRecord:
        try:
            run_steps(self.steps, ctx, progress, ctx.undo_log)
        except CkptdError as exc:
            exc.pid = exc.pid or ctx.request.pid
            exc.checkpoint_id = exc.checkpoint_id or ctx.checkpoint_id
            raise
        finally:
            if ctx.criu is not None:
                ctx.criu.abort()  # never left holding the tree (no-op once finished)
            if ctx.held is not None:
                ctx.held.close()
            self.ghost_budget.give_back(ctx.checkpoint_id)
        assert ctx.record is not None
        if ctx.cuda_resume_error is not None:
            raise self._kept_but_not_resumed(ctx, ctx.cuda_resume_error)
        return ctx.record

    @staticmethod
    def _kept_but_not_resumed(ctx: DumpContext, cause: BaseException) -> GpuFailed:
        """Leave-running, the checkpoint committed, CUDA not resumed: the error that says so
        (the checkpoint stays listed; the journal entry stays for the next start)."""
        pids = ", ".join(map(str, ctx.gpu.cuda_pids))
        message = (
            f"checkpoint {ctx.checkpoint_id} of pid {ctx.request.pid} is committed and kept, "
            f"but the CUDA state of pid(s) {pids} could not be resumed after it: {cause}"
        )
        log.error("%s", message)
        return GpuFailed(
            message, call=getattr(cause, "call", ""), code="RESUME_FAILED",
            hint="the job runs with its CUDA calls blocked until the driver resumes it (a "
            "late driver answer is settled by the daemon; a daemon restart retries the "
            f"resume); or kill the job and `ckptctl restore {ctx.checkpoint_id}`",
            pid=ctx.request.pid, checkpoint_id=ctx.checkpoint_id,
        )

    # ---- steps ----------------------------------------------------------------------------

    def _inspect(self, ctx: DumpContext) -> None:
        status = self._criu.status()
        if not status.ok:
            raise CriuUnavailable(f"cannot checkpoint: {status.message}", pid=ctx.request.pid)
        tree = check_dump_target(
            self._processes, ctx.caller, ctx.request.pid, self._config.daemon_pid
        )
        if ctx.held is not None:
            ctx.held.close()  # preview() may inspect more than once
        ctx.held = HeldTree(self._processes)
        ctx.tree = tuple(ctx.held.hold_facts(tree))
        if not ctx.tree or ctx.tree[0].pid != ctx.request.pid:
            raise ProcessNotFound(f"pid {ctx.request.pid} exited while it was inspected",
                                  pid=ctx.request.pid)
        ctx.container = self._placement(ctx)
        ctx.stdio = self._processes.stdio(ctx.tree)
        connections = self._processes.tcp_connections(ctx.tree)
        check_tcp(connections, ctx.request.pid,
                  tcp_close=(ctx.request.tcp_close
                             or self._config.tcp_outside_peers != "refuse"),
                  peers_dumped=ctx.request.tcp_peers_dumped)
        ctx.tcp_connections = len(connections)
        ctx.stopped_before = frozenset(
            p.pid for p in ctx.tree if ctx.held.state(p.pid) is PidState.STOPPED
        )
        self._gpu.inspect(ctx.gpu, ctx.tree, stopped=ctx.stopped_before)
        # the driver copies device memory into the job's memory: refuse before freezing
        gpumemory.refuse_without_room(self._cgroups, ctx.gpu, ctx.request.pid)
        if self._files is not None:  # refuse a file over the capture limit before freezing
            ctx.written = self._files.written(ctx.tree)
            jobfiles.refuse_oversized(ctx.written, self._config, ctx.request.pid)
            # which of them processes outside the tree write too (recorded, for show)
            ctx.shared = jobfiles.outside_writers(self._files, ctx.written, ctx.tree)
            # ghost files: bounded together per dump and per uid, before freezing
            ctx.ghost_bytes = ghosts.refuse_over_total(
                self._files.ghosts(ctx.tree), self._config, ctx.request.pid)
            self.ghost_budget.take(ctx.checkpoint_id, ctx.tree[0].uid, ctx.ghost_bytes,
                                   self._config.ghost_uid_limit, ctx.request.pid)
            ghosts.refuse_unsafe_relinks(self._files.relink_problems(ctx.tree), ctx.request.pid)
        ctx.fingerprint = replace(self._node.fingerprint(ctx.tree), criu_version=status.version)

    def _placement(self, ctx: DumpContext) -> CriuPlacement | None:
        """A container job (``targets.container_init``): CRIU runs inside the container and
        leaves the tree stopped; the tree is killed through its handles only after CRIU has
        exited (CRIU is a process of the container's pid namespace, killed with it when the
        container's init exits on its job's death)."""
        status = self._processes.status(ctx.request.pid)
        init = container_init(self._processes, ctx.request.pid, status)
        if not init:
            return None
        init_status = self._processes.status(init)
        if init_status.state is PidState.FREE or not ctx.tree[0].ns_pid:
            raise ProcessNotFound(f"the container of pid {ctx.request.pid} (init {init}) "
                                  "exited while it was inspected", pid=ctx.request.pid)
        return CriuPlacement(init=init, init_start_time=init_status.start_time,
                             ns_pid=ctx.tree[0].ns_pid)

    def _journal_begin(self, ctx: DumpContext) -> None:
        assert ctx.undo_log is not None
        ctx.undo_log.begin()
        self._watch(ctx)

    def _journal_end(self, ctx: DumpContext) -> None:
        """The entry ends (the dump done, or rolled back), unless bringing CUDA back failed:
        then it stays, and the next start runs its ResumeCuda again (never forgotten)."""
        assert ctx.undo_log is not None
        if ctx.cuda_resume_error is None:
            ctx.undo_log.end()
        else:
            log.error("dump %s: CUDA not resumed; its journal entry is kept so that the next "
                      "start retries the resume", ctx.checkpoint_id)
        self._guard.release(ctx.checkpoint_id)

    def _watch(self, ctx: DumpContext) -> None:
        """Tell the guard the tree (again once CRIU has said which pids it froze): it acts
        on it at once if the daemon dies (``core.guard``, docs/adr/0016)."""
        self._guard.watch(ctx.checkpoint_id, ctx.held.members() if ctx.held else [],
                          ctx.stopped_before, ctx.request.leave_running)

    # ---- durable undo records (see the module docstring) -----------------------------------

    def _members(self, ctx: DumpContext) -> tuple[tuple[int, int], ...]:
        return tuple((p, s) for p, s in ctx.held.members()) if ctx.held is not None else ()

    def _committed_kills(self, ctx: DumpContext) -> str:
        """The checkpoint whose commit makes the undos of a killing dump moot ("" with
        leave-running: the tree runs on whatever happens)."""
        return "" if ctx.request.leave_running else ctx.checkpoint_id

    def _resume_cuda_record(self, ctx: DumpContext) -> Undo | None:
        if not ctx.gpu.cuda_pids:
            return None
        cuda = set(ctx.gpu.cuda_pids)
        return ResumeCuda(tuple(m for m in self._members(ctx) if m[0] in cuda),
                          unless_committed=self._committed_kills(ctx))

    def _resume_tree_record(self, ctx: DumpContext) -> Undo:
        """Leave-running: the tree runs on whatever the commit's outcome (a CUDA tree is
        stopped from ``let-go`` to ``gpu-resume``), so the record holds after the commit."""
        return ResumeTree(self._members(ctx), tuple(sorted(ctx.stopped_before)),
                          unless_committed=self._committed_kills(ctx))

    def _kill_tree_record(self, ctx: DumpContext) -> Undo | None:
        if ctx.request.leave_running:
            return None
        return KillTree(self._members(ctx), if_committed=ctx.checkpoint_id)

    def _stage(self, ctx: DumpContext) -> None:
        size_hint = sum(p.rss for p in ctx.tree)
        ctx.images_dir = self._store.begin(ctx.checkpoint_id, size_hint,
                                           ghost_bytes=ctx.ghost_bytes)
        ctx.work_dir = self._config.work_dir / ctx.checkpoint_id
        ctx.work_dir.mkdir(parents=True, exist_ok=True)

    def _unstage(self, ctx: DumpContext) -> None:
        self._store.abort(ctx.checkpoint_id)

    def _gpu_lock(self, ctx: DumpContext) -> None:
        self._gpu.lock(ctx.gpu)

    def _gpu_checkpoint(self, ctx: DumpContext) -> None:
        self._gpu.checkpoint(ctx.gpu)

    def _gpu_resume(self, ctx: DumpContext) -> None:
        """gpu-lock's undo; a failure is remembered, so the journal entry is kept."""
        try:
            self._resume_cuda(ctx)
        except Exception as exc:
            ctx.cuda_resume_error = exc
            raise

    def _gpu_resume_if_running(self, ctx: DumpContext) -> None:
        """With --leave-running the tree runs on: give it its GPUs back once the checkpoint
        is committed (its device memory is in the images), each CUDA process held but its
        restore thread, then let the tree go; otherwise it is killed after the commit. A
        failure here must not cost the valid checkpoint: it is kept, the journal entry too
        (its ResumeCuda retried at the next start), and ``run`` raises saying so once the
        dump is done; the tree is let go all the same (never left stopped, nothing held)."""
        if not ctx.request.leave_running:
            return
        try:
            self._resume_cuda(ctx)
        except Exception as exc:
            ctx.cuda_resume_error = exc
        finally:
            self._let_tree_go(ctx)

    def _stop_for_cuda(self, ctx: DumpContext) -> None:
        """While CRIU still holds the tree (ptrace, at post-dump): SIGSTOP every process of
        it not stopped before the dump. The signal stays pending while CRIU traces it and is
        delivered as CRIU detaches, before the process runs any of its code — what CRIU's
        own ``leave_stopped`` does (compel_resume_task: SIGSTOP, then PTRACE_DETACH). So a
        tree whose CUDA is checkpointed never runs until ``_resume_cuda`` has it back."""
        held = ctx.held
        if held is None:
            return
        stopped = [p for p in held.pids if p not in ctx.stopped_before
                   and held.signal(p, signal.SIGSTOP)]
        ctx.stopped_for_cuda = tuple(dict.fromkeys(ctx.stopped_for_cuda + tuple(stopped)))
        log.debug("dump %s: %s stopped until their CUDA state is back", ctx.checkpoint_id,
                  stopped)

    def _let_tree_go(self, ctx: DumpContext) -> None:
        """SIGCONT what ``_stop_for_cuda`` stopped (those still stopped)."""
        held = ctx.held
        if held is None:
            return
        for pid in ctx.stopped_for_cuda:
            if held.state(pid) is PidState.STOPPED:
                held.signal(pid, signal.SIGCONT)
        ctx.stopped_for_cuda = ()

    def _resume_cuda(self, ctx: DumpContext) -> None:
        """CUDA back to RUNNING, each process's other threads held meanwhile (only the
        driver's restore thread runs, docs/adr/0019): those CUDA processes stopped now
        (CRIU left the tree stopped) are SIGCONTed once held; running ones are not
        signalled."""
        held = ctx.held
        stopped = [p for p in ctx.gpu.cuda_pids if held is not None and p in held
                   and held.state(p) is PidState.STOPPED]

        def cont() -> None:
            for pid in stopped:
                assert held is not None
                held.signal(pid, signal.SIGCONT)

        self._gpu.resume(ctx.gpu, cont=cont)

    def _gate(self, ctx: DumpContext) -> None:
        if ctx.gate is not None:
            ctx.gate(ctx.checkpoint_id)

    def _criu_dump(self, ctx: DumpContext) -> None:
        assert ctx.images_dir is not None and ctx.work_dir is not None
        job = CriuDumpJob(
            pid=ctx.request.pid,
            images_dir=ctx.images_dir,
            work_dir=ctx.work_dir,
            leave_running=ctx.request.leave_running,
            leave_stopped=not ctx.request.leave_running,
            tcp_established=ctx.tcp_connections > 0,
            container=ctx.container,
            ghost_limit=self._config.ghost_limit,
            # pages straight into the store as CRIU sends them, when the store does that
            page_sink=(None if ctx.container is not None
                       else self._store.page_sink(ctx.checkpoint_id, ctx.tree[0].uid)),
        )
        started = self._clock.monotonic()
        ctx.criu = self._criu.dump(job, self._hooks)
        ctx.criu_s = self._clock.monotonic() - started
        ctx.tree = self._dumped_tree(ctx, ctx.criu.pids)
        if ctx.undo_log is not None:  # the pids to kill or resume are the ones CRIU froze
            ctx.undo_log.record("criu-dump", self._resume_tree_record(ctx))
        self._watch(ctx)
        if not ctx.caller.is_root:
            for proc in ctx.tree:
                if proc.uid != ctx.caller.uid:
                    raise PermissionDenied(
                        f"process {proc.pid} ({proc.comm}) joined the tree of pid "
                        f"{ctx.request.pid} during the dump and belongs to uid {proc.uid}, the "
                        f"caller is uid {ctx.caller.uid}",
                        pid=ctx.request.pid,
                    )
        self._check_tcp_images(ctx, job)

    def _check_tcp_images(self, ctx: DumpContext, job: CriuDumpJob) -> None:
        """What a restore needs for TCP is decided from what CRIU dumped, not from what was
        seen before the freeze: every connection in the images (any state, TCP_CLOSE
        included) makes the restore pass CRIU ``tcp_established`` (or ``tcp_close``). One the
        dump did not lock (a socket that got a peer after ``inspect``) would not restore:
        the dump fails before its commit (CRIU resumes the tree)."""
        assert ctx.criu is not None
        dumped = ctx.criu.tcp_sockets
        if dumped is None:  # images not read: the inspection's count stands
            return
        if dumped and not job.tcp_established:
            conn = dumped[0]
            raise CriuFailed(
                f"CRIU dumped a TCP connection {conn.local} -> {conn.remote} ({conn.state}) of "
                f"the tree of pid {ctx.request.pid} that was not there when it was inspected, "
                "so it was not locked and a restore could not bring it back: nothing was "
                "committed, the tree runs on",
                hint="dump it again", pid=ctx.request.pid,
            )
        ctx.tcp = dumped
        ctx.tcp_connections = len(dumped)

    def _dumped_tree(self, ctx: DumpContext, pids: tuple[int, ...]) -> tuple[ProcessFact, ...]:
        """The tree CRIU actually froze (children may have come and gone since ``inspect``),
        each held. ``pids`` are CRIU's: pids in the root's namespace, mapped through /proc."""
        assert ctx.held is not None
        try:
            live = self._processes.tree(ctx.request.pid)
        except CkptdError:
            live = ()
        if live and live[0].start_time != ctx.tree[0].start_time:
            live = ()  # the root's pid is another process's now: nothing of it is ours
        if not pids:
            return tuple(ctx.held.hold_facts(live)) or ctx.tree
        facts, unknown = map_image_pids(pids, ctx.tree, live)
        if unknown:
            log.warning("dump of pid %d: CRIU dumped pids %s (in the tree's namespace) that "
                        "are gone here; nothing is sent to them", ctx.request.pid, unknown)
        return tuple(ctx.held.hold_facts(facts))

    def _abort_criu(self, ctx: DumpContext) -> None:
        """CRIU resumes what it froze (and unlocks the network) — a CUDA tree CRIU still
        holds is stopped first (``_stop_for_cuda``), so that CRIU's resume leaves it stopped;
        then every process of the tree that was not stopped before the dump is made to run
        — a CUDA tree's CUDA brought back first, each process held but its restore thread
        (docs/adr/0019; a failure is remembered and raised again by gpu-lock's undo)."""
        if ctx.criu is not None:
            if ctx.gpu.locked and ctx.criu_result is None:
                self._stop_for_cuda(ctx)
            ctx.criu.abort()
        if ctx.gpu.cuda_pids:
            with contextlib.suppress(Exception):
                self._gpu_resume(ctx)
        self._resume_tree(ctx)

    def _precopy_files(self, ctx: DumpContext) -> None:
        if self._files is None:
            return
        assert ctx.images_dir is not None
        ctx.precopies = jobfiles.precopy(self._files, ctx.written, ctx.images_dir, self._config)

    def _capture_files(self, ctx: DumpContext) -> None:
        # a lock CRIU's restore drops (a POSIX lock on a file the process maps: SQLite WAL's
        # -shm) is said with the checkpoint, as a file not captured (ckptctl show, dump)
        lost_locks = () if ctx.images_dir is None else self._criu.lost_locks(ctx.images_dir)
        for lost in lost_locks:
            log.warning("dump %s: lock not captured: %s", ctx.checkpoint_id, lost)
            ctx.notes.append(f"not captured: {lost}")
            ctx.lost_locks.append(lost)
        if self._files is None:
            ctx.files_skipped = tuple(ctx.lost_locks)
            return
        assert ctx.images_dir is not None
        dir_files = (self._files if ctx.container is None or not ctx.request.files_dirs
                     else self._files.seen_by(ctx.request.pid))
        captured = jobfiles.capture(self._files, ctx.tree, ctx.images_dir, self._config,
                                    ctx.request.pid, ctx.precopies, ctx.shared,
                                    ctx.request.files_dirs, dir_files)
        ctx.files = tuple(captured.files)
        ctx.files_skipped = (*captured.skipped, *ctx.lost_locks)
        for skipped in captured.skipped:
            log.warning("dump %s: file not captured: %s", ctx.checkpoint_id, skipped)
            ctx.notes.append(f"not captured: {skipped}")
        self._record_link_remaps(ctx)

    def _record_link_remaps(self, ctx: DumpContext) -> None:
        """CRIU at post-dump, every link-remap file it made still on disk: the name each is
        linked as, recorded with the images (``RELINKS_IMAGE``), so that a restore can link
        it again once it is gone (a leave-running dump's CRIU removes them, a killing one's
        ckptd, at ``release``). One linked as nothing else in its directory would never
        restore: the dump is refused before its commit (docs/adr/0028)."""
        assert self._files is not None and ctx.images_dir is not None
        found = self._criu.restore_paths(ctx.images_dir, None).relinks
        if not found:
            return
        files = self._files if ctx.container is None else self._files.seen_by(ctx.request.pid)
        ctx.relinks = files.link_remaps(found)
        ghosts.refuse_unlinked_remaps(ctx.relinks, ctx.request.pid)
        (ctx.images_dir / RELINKS_IMAGE).write_bytes(encode_relinks(ctx.relinks))
        ctx.relinks_in = files

    def _let_go(self, ctx: DumpContext) -> None:
        assert ctx.criu is not None
        if ctx.request.leave_running and ctx.gpu.locked:
            self._stop_for_cuda(ctx)  # runs again only once its CUDA is back (gpu-resume)
        if ctx.request.leave_running or not ctx.criu.holds_connections:
            self._finish_criu(ctx)

    def _finish_criu(self, ctx: DumpContext) -> None:
        assert ctx.criu is not None
        if ctx.criu_result is None:
            ctx.criu_result = ctx.criu.finish()

    def _resume_tree(self, ctx: DumpContext) -> None:
        if ctx.held is None:
            return
        with contextlib.suppress(CkptdError):
            live = self._processes.tree(ctx.request.pid)
            if live and live[0].start_time == ctx.tree[0].start_time:
                ctx.held.hold_facts(live)
        self.undoer.resume_tree(ctx.held, ctx.stopped_before)

    def preview(self, caller: Caller, request: DumpRequest) -> CheckpointRecord:
        """The record a dump of ``request`` would make now, without touching the tree (for a
        target node to check it can restore it): same refusals as a dump's first step."""
        ctx = self.new_context(caller, request)
        try:
            self._inspect(ctx)
            if self._files is not None:  # what the dump will capture (a target checks paths)
                ctx.files = tuple(
                    jobfiles.planned(w) for w in ctx.written
                    if w.size <= self._config.file_capture_limit
                )
            return self._record(ctx)
        finally:
            if ctx.held is not None:
                ctx.held.close()
            self.ghost_budget.give_back(ctx.checkpoint_id)

    def _commit(self, ctx: DumpContext) -> None:
        assert ctx.criu is not None
        self._guard.phase(ctx.checkpoint_id, GuardPhase.UNSURE)
        ctx.record = self._store.commit(self._record(ctx))
        self._guard.phase(ctx.checkpoint_id, GuardPhase.COMMITTED)

    def _uncommit(self, ctx: DumpContext) -> None:
        """A step after the commit failed (CRIU could not finish: the tree runs on): the
        checkpoint goes, so that what is listed is what happened."""
        self._guard.phase(ctx.checkpoint_id, GuardPhase.UNSURE)  # listed until deleted
        if ctx.record is not None:
            self._store.delete(ctx.record.id)
            ctx.record = None

    def _record(self, ctx: DumpContext) -> CheckpointRecord:
        return CheckpointRecord(
            id=ctx.checkpoint_id,
            pid=ctx.request.pid,
            created=ctx.started,
            node=self._config.node,
            uid=ctx.tree[0].uid,
            name=ctx.request.name,
            labels=dict(ctx.request.labels),
            leave_running=ctx.request.leave_running,
            processes=ctx.tree,
            stdio=ctx.stdio,
            frozen_s=ctx.criu_result.frozen_s if ctx.criu_result else ctx.criu_s,
            criu_version=self._criu.status().version,
            parent_id=self._parent_of(ctx),
            duration_s=self._clock.time() - ctx.started,
            gpu=ctx.gpu.facts(),
            fingerprint=ctx.fingerprint,
            files=ctx.files,
            files_skipped=ctx.files_skipped,
            tcp_connections=ctx.tcp_connections,
            tcp_close=ctx.request.tcp_close and ctx.tcp_connections > 0,
            tcp=ctx.tcp,
            container=ctx.container is not None,
            container_memory_limit=self._memory_limit(ctx.container),
        )

    def _memory_limit(self, where: CriuPlacement | None) -> int:
        if where is None or self._cgroups is None:
            return 0
        try:
            limit = self._cgroups.memory_limit(where.init)
        except CkptdError:
            return 0
        return limit.limit if limit is not None else 0

    def _parent_of(self, ctx: DumpContext) -> str:
        earlier = [r for r in self._store.list() if r.pid == ctx.request.pid]
        return earlier[-1].id if earlier else ""

    def _release(self, ctx: DumpContext) -> None:
        """Kill the tree (unless leave-running) and wait until every process of it is dead
        (a zombie or gone): a restore right after, here or on a node sharing the pid space,
        must find the pids free."""
        if not ctx.request.leave_running and ctx.held is not None:
            self.undoer.kill_tree(ctx.held, wait_s=KILL_WAIT_S)
        if not ctx.request.leave_running and ctx.relinks_in is not None:
            # CRIU leaves them after a dump that kills: the checkpoint no longer needs them
            ctx.relinks_in.remove_link_remaps(ctx.relinks)
        self._journal_end(ctx)
