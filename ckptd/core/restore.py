"""The restore recipe: the one place that says how a checkpoint becomes a running tree again.

Order, and what undoes each step if a later one fails:

    resolve       find the checkpoint (id, or latest of a pid / name); check the caller   -
    compat        this node fits the checkpoint (``core.compat``: architecture, CPU flags,  -
                  files, kernel, CRIU, libc; CUDA trees: GPU model, count, memory, driver);
                  refuses with every blocking difference, and with every warning unless
                  the request says ``ignore_warnings``
    pids          every pid of the tree must be free (a zombie is waited for, bounded);   -
                  a tree that was the init of its own pid namespace gets a new one: its
                  pids cannot clash
    cgroup        where the tree will live: the caller's cgroup; one of its own under     -
                  ``jobs_cgroup`` when the daemon asks (or the caller is in the daemon's
                  cgroup), so that a daemon restart never touches it (docs/adr/0010)
    checkout      CRIU's image directory from the store; streamed (``stream_restore``):   release it
                  an empty one, the images read from the store as CRIU asks for them,
                  every byte verified on the way (a failure undoes CRIU's restore at
                  post-restore, before the tree runs), only the captured files written
    stdio         replacements for stdio whose other end was outside the tree             close ours
    files         every file the checkpoint captured is put back                          as found
                  (``core.jobfiles``); a version that differs is kept beside it
    criu-restore  CRIU, placed in that cgroup before it begins, recreates the tree there   -
                  (every process checked at post-restore, before it runs) and resumes it;
                  a CUDA tree (or a group member) it leaves stopped
    gpu-restore   a CUDA tree, still stopped: every thread of each CUDA process but its   -
                  restore thread held (``ThreadHold``, ptrace, as CRIU's CUDA plugin does),
                  those processes SIGCONTed (only the restore threads run: the driver works
                  on them), CUDA restored (GPUs remapped by UUID if they differ) and
                  unlocked, the holds released, then the tree SIGCONTed (docs/adr/0019);
                  if that fails the restored tree is killed, none of its own code having run

Durable undo (``core.undo``): at CRIU's post-restore notification, when the tree exists but
has not run (until then CRIU undoes a restore it cannot finish, its daemon killed included),
KillTree of the restored processes is journaled (a group member held at the gate: only
while it is still stopped); the entry ends when the restore has finished or been rolled back.
A daemon killed in between has the half-restored tree killed at its restart, its checkpoint
untouched. Each file put back has its ``UndoPutBack`` journaled before its effect exists
(``core.jobfiles``): a daemon killed during the put-back or CRIU's restore has every file
made again as found at its restart. stdio is undone in-process only (not yet durable).

Invariants: the restored processes are held (``core.held``) from CRIU's post-restore
notification on, before they run, and signalled only through those handles; nothing on the
node changes before ``pids`` passed (and CRIU is never called for a checkpoint that does not
fit the node); a failed CRIU restore leaves
no part of the tree behind (CRIU kills what it created); the restored tree is not a child of
the daemon (CRIU's process forks it and exits), so stopping the daemon never touches it; with
a ``Cgroups`` port, no process of the restored tree ever runs outside the cgroup chosen for it
(CRIU is moved there before it creates anything, so the tree's memory is charged there too).
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.core.callers import caller_process
from ckptd.core.compat import (
    check_restore,
    gpu_problems,
    refuse_unless_compatible,
    show_tcp,
    tcp_missing,
)
from ckptd.core.config import CoreConfig
from ckptd.core.gpu import GpuSession, GpuSteps
from ckptd.core.held import HeldTree, pid_map
from ckptd.core.intocontainer import (
    CallerContainer,
    caller_container,
    check_pids_free,
    memory_problems,
)
from ckptd.core.jobfiles import PutBackAll
from ckptd.core.ports import (
    Cgroups,
    CheckpointStore,
    Clock,
    Criu,
    CriuHooks,
    CriuRestoreJob,
    ImageSource,
    InheritFd,
    JobFiles,
    Journal,
    NodeInspector,
    ProcessTable,
    StdioProvider,
)
from ckptd.core.recipe import ProgressSink, Step, run_steps
from ckptd.core.rollback import Undoer
from ckptd.core.undo import KillTree, UndoLog
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CompatReport,
    PidState,
    ProcessFact,
    RestoreOutcome,
    RestoreRequest,
    TcpConnection,
)
from ckptd.domain.model import ROOT
from ckptd.errors import (
    CgroupUnavailable,
    CheckpointNotFound,
    CkptdError,
    CriuFailed,
    CriuUnavailable,
    GpuMismatch,
    InvalidTarget,
    PermissionDenied,
    PidInUse,
    PreconditionFailed,
    ProcessNotFound,
)

log = logging.getLogger(__name__)


@dataclass
class RestoreContext:
    caller: Caller
    request: RestoreRequest
    op_id: str
    started: float
    record: CheckpointRecord | None = None
    tcp_closed: tuple[TcpConnection, ...] = ()
    """The recorded connections whose local address this node lacks: the restore brings the
    tree's connections back closed (CRIU: all or none), its outcome naming these."""
    images_dir: Path | None = None
    output_path: Path | None = None
    inherit_fds: tuple[InheritFd, ...] = ()
    pid: int = 0
    gpu_map: dict[str, str] | None = None
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    gate: Callable[[int], None] | None = None
    """Group restores: CRIU leaves the tree stopped; called with its root pid; returns to let
    it run (SIGCONT), raises to kill it."""
    held: HeldTree | None = None
    """The restored processes, held from CRIU's post-restore notification (before they run)."""
    restored: tuple[ProcessFact, ...] = ()
    """The restored tree as /proc shows it (pids on this node; ``ns_pid`` in its namespace)."""
    files: PutBackAll | None = None
    cgroup: str = ""
    """The cgroup the restored tree goes into ("" when ckptd places nothing)."""
    create_cgroup: bool = False
    """``cgroup`` is one of the tree's own, created for it."""
    into: CallerContainer | None = None
    """Restoring into the caller's container (``RestoreRequest.into_callers_container``)."""
    images: ImageSource | None = None
    """A streamed restore: CRIU reads the images from here (``images_dir`` holds only the
    captured files)."""
    undo_log: UndoLog | None = None
    """The restore's durable undo records (journal entry ``op_id``)."""


def find_checkpoint(
    store: CheckpointStore, request: RestoreRequest, caller: Caller = ROOT
) -> CheckpointRecord:
    """The checkpoint a restore request names. Raises CheckpointNotFound.

    Invariant (issue 21): names are scoped by owner. A lookup by pid or name sees only the
    caller's own checkpoints (root: everyone's), so another user's checkpoint is never
    picked, and its id never shown; root is refused (InvalidTarget) when owners share the
    name, and asked for the id."""
    if request.checkpoint_id:
        return store.get(request.checkpoint_id)
    records = [r for r in store.list() if caller.is_root or r.uid == caller.uid]
    if request.pid:
        matches = [r for r in records if r.pid == request.pid]
        what = f"pid {request.pid}"
    elif request.name:
        matches = [r for r in records if r.name == request.name]
        what = f"name {request.name!r}"
        owners = sorted({r.uid for r in matches})
        if len(owners) > 1:
            raise InvalidTarget(
                f"checkpoints named {request.name!r} belong to uids "
                f"{', '.join(map(str, owners))}: which one is meant cannot be told",
                hint=f"give the checkpoint id (`ckptctl list --name {request.name}` lists "
                     "them with their owners)")
    else:
        raise CheckpointNotFound(
            "no checkpoint named", hint="give a checkpoint id, a pid or a name"
        )
    if not matches:
        raise CheckpointNotFound(f"no checkpoint of {what}", pid=request.pid or None)
    return max(matches, key=lambda r: (r.created, r.id))


class RestoreRecipe:
    def __init__(
        self,
        *,
        criu: Criu,
        processes: ProcessTable,
        store: CheckpointStore,
        stdio: StdioProvider,
        clock: Clock,
        config: CoreConfig,
        gpu: GpuSteps,
        node: NodeInspector,
        hooks: CriuHooks | None = None,
        files: JobFiles | None = None,
        cgroups: Cgroups | None = None,
        journal: Journal | None = None,
    ) -> None:
        self._cgroups = cgroups
        self._gpu = gpu
        self._node = node
        self._files = files
        self._criu = criu
        self._processes = processes
        self._store = store
        self._journal = journal
        self.undoer = Undoer(processes=processes, store=store, clock=clock, config=config,
                             gpu=gpu, files=files)
        self._stdio = stdio
        self._clock = clock
        self._config = config
        self._hooks = hooks or CriuHooks()
        self.steps: tuple[Step[RestoreContext], ...] = (
            Step("resolve", self._resolve, None, "finding the checkpoint"),
            Step("compat", self._compat, None, "checking that this node fits the checkpoint"),
            Step("pids", self._wait_pids_free, None, "checking that the tree's pids are free"),
            Step("cgroup", self._choose_cgroup, None, "choosing the tree's cgroup"),
            Step("checkout", self._checkout, None, "reading the checkpoint from the store"),
            Step("stdio", self._stdio_replacements, self._undo_output, "preparing stdio"),
            Step("files", self._put_back_files, self._undo_files,
                 "putting back the files the tree writes"),
            Step("criu-restore", self._criu_restore, None, "CRIU is restoring the tree"),
            Step("gate", self._gate, self._kill_restored, "waiting for every member"),
            Step("gpu-restore", self._gpu_restore, None, "restoring GPU state"),
        )

    @property
    def job_files(self) -> JobFiles | None:
        """The port files are put back through (recovery undoes put-backs with it)."""
        return self._files

    def new_context(self, caller: Caller, request: RestoreRequest, op_id: str) -> RestoreContext:
        return RestoreContext(caller, request, op_id, self._clock.time(),
                              undo_log=UndoLog(self._journal, op_id, "restore"))

    def resolve(self, ctx: RestoreContext) -> CheckpointRecord:
        """Run the resolve step alone (the caller needs the pid to lock before the rest)."""
        self._resolve(ctx)
        assert ctx.record is not None
        return ctx.record

    def run(self, ctx: RestoreContext, progress: ProgressSink) -> RestoreOutcome:
        try:
            with ctx.resources:
                run_steps(self.steps, ctx, progress)
        except Exception as exc:
            if ctx.undo_log is not None:
                ctx.undo_log.end()  # rolled back (a dying daemon never gets here)
            if isinstance(exc, CkptdError) and ctx.record is not None:
                exc.checkpoint_id = exc.checkpoint_id or ctx.record.id
                exc.pid = exc.pid or ctx.record.pid
            raise
        else:
            if ctx.undo_log is not None:
                ctx.undo_log.end()  # the tree runs
            if ctx.files is not None:
                ctx.files.prune(self._config.aside_keep, self._config.aside_max_age_s)
        finally:
            if ctx.held is not None:
                ctx.held.close()
        assert ctx.record is not None
        return RestoreOutcome(
            checkpoint_id=ctx.record.id,
            pid=ctx.pid,
            ns_pid=ctx.record.processes[0].image_pid if ctx.into and ctx.record.processes
            else 0,
            output_path=str(ctx.output_path) if ctx.inherit_fds and ctx.output_path else "",
            cgroup=ctx.cgroup,
            duration_s=self._clock.time() - ctx.started,
            stdio=ctx.record.stdio,
            files_put_back=tuple(ctx.files.put_back) if ctx.files else (),
            files_kept=ctx.files.kept if ctx.files else (),
            tcp_closed=(f"{len(ctx.record.tcp)} TCP connection(s) restored closed: this node "
                        f"lacks the local address of {show_tcp(ctx.tcp_closed)}"
                        if ctx.tcp_closed else ""),
        )

    # ---- steps ----------------------------------------------------------------------------

    def _resolve(self, ctx: RestoreContext) -> None:
        if ctx.record is not None:
            return
        record = find_checkpoint(self._store, ctx.request, ctx.caller)
        if not ctx.caller.is_root and record.uid != ctx.caller.uid:
            raise PermissionDenied(
                f"checkpoint {record.id} belongs to uid {record.uid}, the caller is uid "
                f"{ctx.caller.uid}",
                checkpoint_id=record.id,
            )
        if not ctx.caller.is_root:
            for proc in record.processes:
                if proc.uid != ctx.caller.uid:
                    raise PermissionDenied(
                        f"checkpoint {record.id} contains process {proc.pid} ({proc.comm}) of "
                        f"uid {proc.uid}, the caller is uid {ctx.caller.uid}",
                        checkpoint_id=record.id,
                    )
        if ctx.request.into_callers_container:
            ctx.into = caller_container(self._processes, ctx.caller, record)
        status = self._criu.status()
        if not status.ok:
            raise CriuUnavailable(f"cannot restore: {status.message}", checkpoint_id=record.id)
        ctx.record = record

    def check(
        self, record: CheckpointRecord, gpu_map: Mapping[str, str] | None = None
    ) -> CompatReport:
        """Every blocking difference and warning between ``record`` and this node (a CRIU
        that cannot run here is one)."""
        criu = self._criu.status()
        report = check_restore(
            record,
            self._node,
            criu_version=criu.version,
            gpu=self._gpu,
            gpu_map=gpu_map,
            files=self._files,
        )
        if not criu.ok:
            report = replace(
                report, blocking=(f"CRIU cannot run on this node: {criu.message}",
                                  *report.blocking)
            )
        return report

    def _compat(self, ctx: RestoreContext) -> None:
        """Refuse a checkpoint that does not fit this node. When only the GPUs do not fit,
        the GPU plan's own error (GpuMismatch / GpuUnavailable, every GPU problem in it)."""
        record = ctx.record
        assert record is not None
        if record.container and ctx.into is None:
            raise PreconditionFailed(
                f"checkpoint {record.id} is of a job in a container (pids "
                f"{', '.join(str(p.image_pid) for p in record.processes[:3])} of the "
                "container's pid namespace): it can only be restored inside a container",
                hint=f"start the next container with `ckptctl run --name "
                     f"{record.name or 'NAME'} -- CMD` as its entrypoint: it restores the "
                     "newest checkpoint of that name into itself",
                checkpoint_id=record.id,
            )
        if record.gpu is None and ctx.request.gpu_map:
            raise GpuMismatch(
                f"--gpu-map given but checkpoint {record.id} holds no CUDA process",
                hint="leave --gpu-map out",
            )
        node, files = self._node, self._files
        if ctx.into is not None:  # the job's files as the new container sees them
            node = node.seen_by(ctx.into.init)
            files = files.seen_by(ctx.into.init) if files is not None else None
        report = check_restore(
            record, node, criu_version=self._criu.status().version, include_gpu=False,
            files=files,
        )
        if ctx.into is not None:
            more = memory_problems(self._cgroups, ctx.into, record)
            report = replace(report, blocking=report.blocking + tuple(more))
        if record.gpu is not None:
            # into a container: only the GPUs its device nodes and environment give it
            visible = self._gpu.visible_to(ctx.into.init) if ctx.into is not None else None
            if report.blocking:
                more = gpu_problems(record, self._gpu, ctx.request.gpu_map, visible)
                report = replace(report, blocking=report.blocking + tuple(more))
            else:
                ctx.gpu_map = self._gpu.plan_restore(record.gpu, dict(ctx.request.gpu_map),
                                                     visible)
        ctx.tcp_closed = tcp_missing(record, node)  # a container's: in its network namespace
        refuse_unless_compatible(
            record, report, ignore_warnings=ctx.request.ignore_warnings,
            where="this node" if ctx.into is None else f"the container of pid {ctx.into.init}")

    def _gate(self, ctx: RestoreContext) -> None:
        """Group restores only: hold the stopped tree until every member is restored."""
        if ctx.gate is None:
            return
        assert ctx.record is not None
        ctx.gate(ctx.pid)
        assert ctx.held is not None
        if ctx.record.gpu is None:  # a CUDA tree runs once its CUDA is back (gpu-restore)
            ctx.held.signal_all(signal.SIGCONT)

    def _kill_restored(self, ctx: RestoreContext) -> None:
        if ctx.gate is None or ctx.held is None:
            return
        self.undoer.kill_tree(ctx.held)

    def _gpu_restore(self, ctx: RestoreContext) -> None:
        assert ctx.record is not None
        if ctx.record.gpu is None:
            return
        restored = pid_map(ctx.record.processes, ctx.restored)
        cuda = tuple(restored.get(p, p) for p in ctx.record.gpu.cuda_pids)
        session = GpuSession(cuda_pids=cuda, locked=list(cuda), checkpointed=list(cuda))
        held = ctx.held

        def cont() -> None:  # the CUDA processes, their threads held but the restore threads
            for pid in cuda:
                if held is not None and pid in held:
                    held.signal(pid, signal.SIGCONT)

        try:
            self._gpu.resume(session, ctx.gpu_map, cont=cont)
        except Exception:
            if held is not None:
                self.undoer.kill_tree(held)
            raise
        if held is not None:
            held.signal_all(signal.SIGCONT)  # CUDA is back: now the whole tree runs

    def _wait_pids_free(self, ctx: RestoreContext) -> None:
        assert ctx.record is not None
        if ctx.into is not None:
            check_pids_free(self._processes, ctx.into, ctx.record)
            return
        if ctx.record.own_pid_namespace:
            return  # restored into a new pid namespace: its pids are all free there
        deadline = self._clock.monotonic() + self._config.zombie_wait_s
        for proc in ctx.record.processes:
            while True:
                status = self._processes.status(proc.pid)
                if status.state is PidState.FREE:
                    break
                if status.state is not PidState.ZOMBIE:
                    raise PidInUse(
                        f"pid {proc.pid} is in use by a running process ({status.comm}, parent "
                        f"{status.ppid}); checkpoint {ctx.record.id} needs it",
                        hint=f"stop pid {proc.pid} first, or restore on another node",
                        pid=proc.pid,
                        checkpoint_id=ctx.record.id,
                    )
                if self._clock.monotonic() >= deadline:
                    raise PidInUse(
                        f"pid {proc.pid} is still held by a zombie ({status.comm}) that its "
                        f"parent pid {status.ppid} has not reaped after "
                        f"{self._config.zombie_wait_s:g}s",
                        hint=f"make pid {status.ppid} reap its child (or end it), then retry",
                        pid=proc.pid,
                        checkpoint_id=ctx.record.id,
                    )
                self._clock.sleep(0.05)

    def _checkout(self, ctx: RestoreContext) -> None:
        """The images CRIU restores from: read from the store as CRIU asks for them when
        streaming (``stream_restore``, a CRIU that can, not into a container), the
        captured files alone written out (put back before CRIU runs); else the whole image
        directory, written first."""
        assert ctx.record is not None
        if ctx.images_dir is not None:
            return  # staged images given by the caller (a migration's target)
        if self._streams(ctx):
            ctx.images_dir, ctx.images = ctx.resources.enter_context(
                self._store.checkout_streamed(ctx.record.id))
            for captured in ctx.record.files:
                ctx.images.write(captured.image, ctx.images_dir / captured.image)
            return
        ctx.images_dir = ctx.resources.enter_context(self._store.checkout(ctx.record.id))

    def _streams(self, ctx: RestoreContext) -> bool:
        return (self._config.stream_restore and ctx.into is None
                and self._criu.can_stream_restore())

    def _stdio_replacements(self, ctx: RestoreContext) -> None:
        assert ctx.record is not None
        if ctx.into is not None:  # the container's own stdio (its log stream)
            ctx.inherit_fds = ctx.resources.enter_context(
                self._stdio.from_process(ctx.record.stdio, ctx.into.init))
            return
        if ctx.request.output_path:
            ctx.output_path = Path(ctx.request.output_path)
        else:
            ctx.output_path = self._config.output_dir / f"{ctx.record.id}.{ctx.op_id}.out"
        root = ctx.record.processes[0] if ctx.record.processes else None
        owner = (root.uid, root.gid) if root is not None else (ctx.record.uid, ctx.record.uid)
        ctx.inherit_fds = ctx.resources.enter_context(
            self._stdio.replacements(ctx.record.stdio, ctx.output_path, owner,
                                     bool(ctx.request.output_path))
        )

    def _undo_output(self, ctx: RestoreContext) -> None:
        """A failed restore leaves no output file of its own: the one ckptd chose, still
        empty (nothing of the tree ran). One the caller named is left as found."""
        if ctx.output_path is None or ctx.request.output_path:
            return
        with contextlib.suppress(OSError):
            if ctx.output_path.stat().st_size == 0:
                ctx.output_path.unlink()

    def _put_back_files(self, ctx: RestoreContext) -> None:
        """Last before CRIU (every refusal is behind us): the captured files as they were at
        the checkpoint. Undone (each file as found) if CRIU then fails."""
        assert ctx.record is not None and ctx.images_dir is not None
        if not ctx.record.files or self._files is None:
            return
        files = self._files if ctx.into is None else self._files.seen_by(ctx.into.init)
        root = (ctx.into.init, ctx.into.start_time) if ctx.into is not None else (0, 0)
        ctx.files = PutBackAll(files, ctx.record, ctx.undo_log, root)
        ctx.files.run(ctx.images_dir, ctx.op_id)

    def _undo_files(self, ctx: RestoreContext) -> None:
        if ctx.files is not None:
            ctx.files.undo()

    def _criu_restore(self, ctx: RestoreContext) -> None:
        assert ctx.images_dir is not None
        work_dir = self._config.work_dir / ctx.op_id
        work_dir.mkdir(parents=True, exist_ok=True)
        assert ctx.record is not None
        job = CriuRestoreJob(
            images_dir=ctx.images_dir, work_dir=work_dir, inherit_fds=ctx.inherit_fds,
            leave_stopped=ctx.gate is not None or ctx.record.gpu is not None,
            tcp_established=ctx.record.tcp_connections > 0,
            tcp_close=ctx.record.tcp_close or bool(ctx.tcp_closed),
            restore_cgroups=not ctx.cgroup and ctx.into is None,
            container=ctx.into.placement() if ctx.into is not None else None,
            images=ctx.images,
        )
        try:
            ctx.pid = self._criu.restore(job, _HoldOnPostRestore(self._hooks, self, ctx))
        except CriuFailed as exc:
            self._await_undone(ctx)
            cause = exc.__cause__
            if isinstance(cause, CgroupUnavailable):  # CRIU undid the restore: say why
                raise CgroupUnavailable(f"restore undone: {cause.message}", hint=cause.hint,
                                        pid=cause.pid) from exc
            raise
        except CkptdError:
            self._await_undone(ctx)
            raise
        if ctx.held is None:  # CRIU did not say the root pid at post-restore
            self.hold_restored(ctx, ctx.pid)

    def _await_undone(self, ctx: RestoreContext) -> None:
        """After a failed streamed restore (damage met while CRIU read, when it may have
        created the tree and killed it before it ran): until the tree's pids are free again
        (the killed tasks reaped), at most ``zombie_wait_s``, so that nothing of it is left
        when the failure is reported."""
        assert ctx.record is not None
        if ctx.images is None or ctx.record.own_pid_namespace:
            return
        deadline = self._clock.monotonic() + self._config.zombie_wait_s
        for proc in ctx.record.processes:
            while (self._processes.status(proc.pid).state is not PidState.FREE
                   and self._clock.monotonic() < deadline):
                self._clock.sleep(0.02)

    def _choose_cgroup(self, ctx: RestoreContext) -> None:
        """The caller's cgroup; a cgroup of its own (``<jobs_cgroup>/<name or id>-<op>``)
        when the caller is the daemon itself, is unknown (pid 0: outside the daemon's pid
        namespace), or is in the daemon's cgroup. ``jobs_cgroup`` empty: the daemon's."""
        if self._cgroups is None:
            return
        assert ctx.record is not None
        if ctx.into is not None:  # CRIU is run in the container's cgroups (every hierarchy)
            ctx.cgroup = self._cgroup_of(ctx.into.init, f"the container's init (pid "
                                                        f"{ctx.into.init})")
            return
        daemon_pid = self._config.daemon_pid
        daemon = self._cgroup_of(daemon_pid, f"the daemon (pid {daemon_pid})")
        caller = ctx.caller.pid or 0
        if caller > 0 and caller != daemon_pid:
            with caller_process(self._processes, ctx.caller,
                                "the cgroup of its restore was chosen"):
                theirs = self._cgroup_of(caller, f"the caller (pid {caller})")
            if not within(theirs, daemon):
                ctx.cgroup = theirs
                log.info("restore %s: into the caller's cgroup %s", ctx.op_id, theirs)
                return
        base = self._config.jobs_cgroup.rstrip("/")
        if not base:
            ctx.cgroup = daemon
            return
        ctx.cgroup = f"{base}/{leaf_name(ctx.record.name or ctx.record.id, ctx.op_id)}"
        ctx.create_cgroup = True
        log.info("restore %s: into a cgroup of its own, %s", ctx.op_id, ctx.cgroup)

    def _cgroup_of(self, pid: int, who: str) -> str:
        assert self._cgroups is not None
        try:
            return self._cgroups.cgroup_of(pid)
        except ProcessNotFound as exc:
            raise CgroupUnavailable(f"{who} is gone: its cgroup cannot be told",
                                    hint="ask again from a running process") from exc

    def place_criu(self, ctx: RestoreContext, criu_pid: int) -> None:
        """CRIU's process into the tree's cgroup, before it creates anything (the tree is
        then born there, and what it restores is charged there)."""
        if not ctx.cgroup or self._cgroups is None or ctx.into is not None:
            return  # (into a container: CRIU's entry moves itself into its cgroups)
        if ctx.create_cgroup:  # leftovers of restores whose trees have ended
            self._cgroups.remove_empty(ctx.cgroup.rsplit("/", 1)[0] or "/")
        self._cgroups.move((criu_pid,), ctx.cgroup, create=ctx.create_cgroup)

    def check_placed(self, ctx: RestoreContext) -> None:
        """At post-restore (the tree exists, has not run): every held process is in the
        tree's cgroup; one that is not is moved there (raises, so CRIU undoes the restore,
        when it cannot be)."""
        if not ctx.cgroup or self._cgroups is None or ctx.held is None:
            return
        astray = []
        for pid in ctx.held.pids:
            with contextlib.suppress(ProcessNotFound):
                if self._cgroups.cgroup_of(pid) != ctx.cgroup:
                    astray.append(pid)
        if astray:
            log.warning("restore %s: pids %s were not born in %s; moving them", ctx.op_id,
                        astray, ctx.cgroup)
            self._cgroups.move(astray, ctx.cgroup)

    def hold_restored(self, ctx: RestoreContext, root_pid: int) -> None:
        """Hold the restored tree rooted at ``root_pid`` (a pid on this node)."""
        if ctx.held is not None or root_pid <= 0:
            return
        ctx.held = HeldTree(self._processes)
        try:
            tree = self._processes.tree(root_pid)
        except CkptdError:
            log.warning("restored root pid %d is already gone", root_pid)
            return
        ctx.restored = tuple(ctx.held.hold_facts(tree))
        if ctx.undo_log is not None and ctx.record is not None:
            ctx.undo_log.op = "held-restore" if ctx.gate is not None else "restore"
            ctx.undo_log.checkpoint_id = ctx.record.id
            ctx.undo_log.record("criu-restore", KillTree(
                tuple((p, s) for p, s in ctx.held.members()),
                only_stopped=ctx.gate is not None))


class _HoldOnPostRestore(CriuHooks):
    """The recipe's hooks, plus: hold the restored tree at ``post_restore``, when it exists
    and has not run yet (so no pid of it can have been reused by the time it is held)."""

    def __init__(self, inner: CriuHooks, recipe: RestoreRecipe, ctx: RestoreContext) -> None:
        self._inner = inner
        self._recipe = recipe
        self._ctx = ctx

    def criu_started(self, criu_pid: int) -> None:
        self._recipe.place_criu(self._ctx, criu_pid)
        self._inner.criu_started(criu_pid)

    def pre_restore(self, pid: int) -> None:
        self._inner.pre_restore(pid)

    def setup_namespaces(self, pid: int) -> None:
        self._inner.setup_namespaces(pid)

    def post_restore(self, pid: int) -> None:
        self._recipe.hold_restored(self._ctx, pid)
        self._recipe.check_placed(self._ctx)
        self._inner.post_restore(pid)

    def pre_resume(self, pid: int) -> None:
        self._inner.pre_resume(pid)

    def post_resume(self, pid: int) -> None:
        self._inner.post_resume(pid)


_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]")


def leaf_name(label: str, op_id: str) -> str:
    """The name of a restored tree's own cgroup: its checkpoint's name (or id) and the
    restore's operation id (unique), with what a cgroup name should not hold replaced."""
    return f"{_UNSAFE.sub('_', label)}-{op_id}"


def within(cgroup: str, ancestor: str) -> bool:
    """``cgroup`` is ``ancestor`` or below it (the root contains only itself here: a caller
    in any other cgroup is not "in the daemon's" because the daemon runs at the root)."""
    if cgroup == ancestor:
        return True
    return ancestor != "/" and cgroup.startswith(ancestor.rstrip("/") + "/")
