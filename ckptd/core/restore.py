"""The restore recipe: the one place that says how a checkpoint becomes a running tree again.

Order, and what undoes each step if a later one fails:

    resolve       find the checkpoint (id, or latest of a pid / name); check the     -
                  caller
    compat        this node fits the checkpoint (``core.compat``: architecture, CPU  -
                  flags, files, kernel, CRIU, libc; CUDA trees: GPU model, count,
                  memory, driver); refuses with every blocking difference, and with
                  every warning unless the request says ``ignore_warnings``
    pids          every pid of the tree must be free (a zombie is waited for,       -
                  bounded); a tree that was the init of its own pid namespace gets a
                  new one: its pids cannot clash
    cgroup        where the tree will live (``core.placement``): the caller's       -
                  cgroup; one of its own under ``jobs_cgroup`` when the daemon asks
                  (or the caller is in the daemon's cgroup), so that a daemon restart
                  never touches it (docs/adr/0010)
    checkout      CRIU's image directory from the store; streamed                   release it
                  (``stream_restore``): an empty one, the images read from the store
                  as CRIU asks for them, every byte verified on the way (a failure
                  undoes CRIU's restore at post-restore, before the tree runs), only
                  the captured files written
    stdio         replacements for stdio whose other end was outside the tree       close ours;
                  (in an output file ckptd chose, or the caller's)                  remove an
                                                                                    empty output
    files         every file the checkpoint captured is put back                    each file
                  (``core.jobfiles``); a version that differs is kept beside it     as found
    paths         every object CRIU will reopen by path for the tree (its images:   release
                  files, mappings, cwd/root, FIFOs, link-remap files) reached with  them
                  no link followed and held; every directory it will create in
                  (ghost files, unix sockets) checked to be root's alone; at
                  post-restore each restored process's descriptors, mappings,
                  cwd, root and executable must be those very objects, or the
                  restore is undone before the tree runs (docs/adr/0017)
    criu-restore  CRIU, placed in that cgroup before it begins, recreates the tree  kill the
                  there (every process held and checked at post-restore, before it  restored tree
                  runs) and resumes it; a CUDA tree (or a group member) it leaves
                  stopped
    gate          group restores only: hold the stopped tree until every member is  -
                  restored (raise: this member is undone); then let it run (a CUDA
                  tree: at gpu-restore)
    gpu-restore   a CUDA tree, still stopped: every thread of each CUDA process     -
                  but its restore thread held (``ThreadHold``, ptrace, as CRIU's
                  CUDA plugin does), those processes SIGCONTed (only the restore
                  threads run: the driver works on them), CUDA restored (GPUs
                  remapped by UUID if they differ) and unlocked, the holds released,
                  then the tree SIGCONTed (docs/adr/0019)

Durable undos (``core.undo``, journal entry ``op_id``, written before the step's effect can
exist; a restarted daemon replays them newest first through ``core.rollback.Undoer``, the code
the in-process undos use): stdio: RemoveOutput of the output file ckptd chose; files: one
UndoPutBack per file, before each effect on it (``core.jobfiles``); criu-restore: KillTree of
the restored processes, at CRIU's post-restore notification, when the tree exists but has not
run (until then CRIU undoes a restore it cannot finish, its daemon killed included; a group
member: only while it is still stopped). The entry ends once the whole tree runs (or the
restore is rolled back): a daemon killed before has the half-restored tree killed, every
file made again as found and its empty output file removed at its restart, the checkpoint
untouched; one killed after touches nothing of a tree that runs. A migration target's restore
(``kept``: ``core.undo.Received``) ends its entry into that record, in the same atomic write.

Invariants: the restored processes are held (``core.held``) from CRIU's post-restore
notification on, before they run, and signalled only through those handles; nothing on the
node changes before ``pids`` passed (and CRIU is never called for a checkpoint that does not
fit the node); a failed CRIU restore leaves no part of the tree behind (CRIU kills what it
created); a failure after it kills the restored tree, none of its own code having run (a
group member, or a CUDA tree, is still stopped then; a plain tree CRIU has resumed); the
restored tree is not a child of the daemon (CRIU's process forks it and exits), so stopping
the daemon never touches it; with a ``Cgroups`` port, no process of the restored tree ever
runs outside the cgroup chosen for it (``core.placement``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.core.compat import (
    check_restore,
    gpu_problems,
    refuse_unless_compatible,
    show_tcp,
    tcp_missing,
)
from ckptd.core.events import EventBus
from ckptd.core.gpu import GpuSession
from ckptd.core.held import HeldTree, pid_map
from ckptd.core.intocontainer import (
    CallerContainer,
    caller_container,
    check_pids_free,
    memory_problems,
)
from ckptd.core.jobfiles import PutBackAll
from ckptd.core.lazyrestore import LazyWatch
from ckptd.core.parts import RecipeParts
from ckptd.core.placement import CgroupPlacement, TreeCgroup
from ckptd.core.ports import (
    CheckpointStore,
    CriuHooks,
    CriuRestoreJob,
    ForwardingHooks,
    ImageSource,
    InheritFd,
    JobFiles,
    PinnedPaths,
    StdioProvider,
)
from ckptd.core.recipe import ProgressSink, Step, run_steps
from ckptd.core.undo import KillTree, RemoveOutput, Undo, UndoLog
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
    PathChanged,
    PermissionDenied,
    PidInUse,
    PreconditionFailed,
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
    checkout: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """The store's checkout, held until the restore ends (checkout's undo releases it)."""
    stdio_fds: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """Our ends of the stdio replacements, held until the restore ends (stdio's undo
    closes them)."""
    gate: Callable[[int], None] | None = None
    """Group restores: CRIU leaves the tree stopped; called with its root pid; returns to let
    it run (SIGCONT), raises to kill it."""
    held: HeldTree | None = None
    """The restored processes, held from CRIU's post-restore notification (before they run)."""
    restored: tuple[ProcessFact, ...] = ()
    """The restored tree as /proc shows it (pids on this node; ``ns_pid`` in its namespace)."""
    files: PutBackAll | None = None
    placed: TreeCgroup = field(default_factory=TreeCgroup)
    """The cgroup the restored tree goes into (``path`` "" when ckptd places nothing)."""
    into: CallerContainer | None = None
    """Restoring into the caller's container (``RestoreRequest.into_callers_container``)."""
    images: ImageSource | None = None
    """A streamed restore: CRIU reads the images from here (``images_dir`` holds only the
    captured files)."""
    undo_log: UndoLog | None = None
    """The restore's durable undo records (journal entry ``op_id``)."""
    events: EventBus | None = None
    """Where a lazy restore tells its end (``core.lazyrestore``)."""
    pins: PinnedPaths | None = None
    """What CRIU reopens by path, held from the paths step until the restore ends."""
    lazy: LazyWatch | None = None
    """A lazy restore's watch: from the checkout on; it takes over what the restore holds
    once the tree runs, until the last page is served."""

    @property
    def cgroup(self) -> str:
        """The cgroup the restored tree goes into ("" when ckptd places nothing)."""
        return self.placed.path


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
    """Restores one checkpoint. Thread-safe: callers serialize per pid (PidLocks)."""

    def __init__(self, parts: RecipeParts, *, stdio: StdioProvider) -> None:
        self.parts = parts
        self._cgroups = parts.cgroups
        self._placement = CgroupPlacement(parts.cgroups, parts.processes, parts.config)
        self._gpu = parts.gpu
        self._node = parts.node
        self._files = parts.files
        self._criu = parts.criu
        self._processes = parts.processes
        self._store = parts.store
        self._journal = parts.journal
        self.undoer = parts.undoer()
        self._stdio = stdio
        self._clock = parts.clock
        self._config = parts.config
        self._hooks = parts.hooks
        self.steps: tuple[Step[RestoreContext], ...] = (
            Step("resolve", self._resolve, None, "finding the checkpoint"),
            Step("compat", self._compat, None, "checking that this node fits the checkpoint"),
            Step("pids", self._wait_pids_free, None, "checking that the tree's pids are free"),
            Step("cgroup", self._choose_cgroup, None, "choosing the tree's cgroup"),
            Step("checkout", self._checkout, self._release_checkout,
                 "reading the checkpoint from the store"),
            Step("stdio", self._stdio_replacements, self._undo_stdio, "preparing stdio",
                 durable=self._remove_output_record),
            Step("files", self._put_back_files, self._undo_files,
                 "putting back the files the tree writes"),
            Step("paths", self._pin_paths, self._unpin_paths,
                 "checking the paths CRIU opens as root"),
            Step("criu-restore", self._criu_restore, self._kill_restored,
                 "CRIU is restoring the tree", durable=self._kill_tree_record),
            Step("gate", self._gate, None, "waiting for every member"),
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
        if ctx.undo_log is not None and ctx.gate is not None:
            ctx.undo_log.op = "held-restore"
        if ctx.undo_log is not None and ctx.record is not None:  # resolved before
            ctx.undo_log.checkpoint_id = ctx.record.id
        try:
            run_steps(self.steps, ctx, progress, ctx.undo_log)
        except Exception as exc:
            if ctx.undo_log is not None:
                ctx.undo_log.end()  # rolled back (a dying daemon never gets here)
            if ctx.lazy is not None:
                ctx.lazy.abandon()
            if isinstance(exc, CkptdError) and ctx.record is not None:
                exc.checkpoint_id = exc.checkpoint_id or ctx.record.id
                exc.pid = exc.pid or ctx.record.pid
            raise
        else:
            if ctx.files is not None:  # before the entry ends: a crash leaves them recorded
                ctx.files.keep_record()
            if ctx.lazy is not None:  # pages still served: the watch ends the entry
                ctx.lazy.adopt(ctx.checkout.pop_all(), ctx.held, ctx.pid, ctx.undo_log)
                ctx.held = None
            elif ctx.undo_log is not None:
                ctx.undo_log.end(done=True)  # the tree runs
            if ctx.files is not None:
                ctx.files.prune(self._config.aside_keep, self._config.aside_max_age_s)
        finally:  # what the steps hold until the restore ends (their undos release it too)
            self._unpin_paths(ctx)
            ctx.stdio_fds.close()
            ctx.checkout.close()  # (empty when a lazy watch took it over)
            if ctx.held is not None:
                ctx.held.close()
        return self._outcome(ctx)

    def _outcome(self, ctx: RestoreContext) -> RestoreOutcome:
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
            files_left=tuple(ctx.files.left) if ctx.files else (),
            tcp_closed=(f"{len(ctx.record.tcp)} TCP connection(s) restored closed: this node "
                        f"lacks the local address of {show_tcp(ctx.tcp_closed)}"
                        if ctx.tcp_closed else ""),
            lazy=ctx.lazy is not None,
        )

    def place_criu(self, ctx: RestoreContext, criu_pid: int) -> None:
        """CRIU's process into the tree's cgroup, before it creates anything."""
        self._placement.place_criu(ctx.placed, criu_pid, ctx.into)

    def check_placed(self, ctx: RestoreContext) -> None:
        """At post-restore (the tree exists, has not run): every held process is in the
        tree's cgroup (``CgroupPlacement.check_placed``)."""
        if ctx.held is not None:
            self._placement.check_placed(ctx.placed, ctx.held.pids, ctx.op_id)

    # ---- steps, in their order ------------------------------------------------------------

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
        if ctx.undo_log is not None:  # its journal entry names it (recovery's line too)
            ctx.undo_log.checkpoint_id = record.id

    def check(
        self, record: CheckpointRecord, gpu_map: Mapping[str, str] | None = None,
        caller: Caller | None = None,
    ) -> CompatReport:
        """Every blocking difference and warning between ``record`` and this node (a CRIU
        that cannot run here is one); ``caller``'s own process and its ancestors are not
        other writers of the captured files (``launchers``)."""
        criu = self._criu.status()
        report = check_restore(
            record,
            self._node,
            criu_version=criu.version,
            gpu=self._gpu,
            gpu_map=gpu_map,
            files=self._files,
            shared_files=self._config.shared_files,
            launchers=self.launchers(caller, record),
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
            files=files, shared_files=self._config.shared_files,
            launchers=self.launchers(ctx.caller, record),
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

    def _choose_cgroup(self, ctx: RestoreContext) -> None:
        assert ctx.record is not None
        ctx.placed = self._placement.choose(ctx.caller, ctx.record, ctx.op_id, ctx.into)

    def _checkout(self, ctx: RestoreContext) -> None:
        """The images CRIU restores from: read from the store as CRIU asks for them when
        streaming (``stream_restore``, a CRIU that can, not into a container), the
        captured files alone written out (put back before CRIU runs); else the whole image
        directory, written first."""
        assert ctx.record is not None
        if ctx.images_dir is not None:
            return  # staged images given by the caller (a migration's target)
        if ctx.request.lazy:
            self._refuse_lazy(ctx)
            ctx.lazy = LazyWatch(checkpoint_id=ctx.record.id, uid=ctx.record.uid,
                                 processes=self._processes, undoer=self.undoer,
                                 events=ctx.events)
        if self._streams(ctx) or ctx.lazy is not None:
            ctx.images_dir, ctx.images = ctx.checkout.enter_context(
                self._store.checkout_streamed(ctx.record.id, lazy=ctx.lazy is not None))
            for captured in ctx.record.files:
                ctx.images.write(captured.image, ctx.images_dir / captured.image)
            return
        ctx.images_dir = ctx.checkout.enter_context(self._store.checkout(ctx.record.id))

    def _refuse_lazy(self, ctx: RestoreContext) -> None:
        """A lazy restore is for a CPU tree restored on the node by a CRIU that streams."""
        assert ctx.record is not None
        why = ("it is a GPU checkpoint (its device memory comes back whole)"
               if ctx.record.gpu is not None
               else "it restores into a container" if ctx.into is not None
               else "it is part of a group restore" if ctx.gate is not None
               else "this daemon does not stream restores (stream_restore = false)"
               if not self._config.stream_restore
               else "this CRIU cannot stream a restore (scripts/install-criu.sh)"
               if not self._criu.can_stream_restore() else "")
        if why:
            raise PreconditionFailed(f"cannot restore {ctx.record.id} lazily: {why}",
                                     hint="restore it without --lazy",
                                     checkpoint_id=ctx.record.id)

    def _streams(self, ctx: RestoreContext) -> bool:
        return (self._config.stream_restore and ctx.into is None
                and self._criu.can_stream_restore())

    @staticmethod
    def _release_checkout(ctx: RestoreContext) -> None:
        ctx.checkout.close()

    def _stdio_replacements(self, ctx: RestoreContext) -> None:
        assert ctx.record is not None
        if ctx.into is not None:  # the container's own stdio (its log stream)
            ctx.inherit_fds = ctx.stdio_fds.enter_context(
                self._stdio.from_process(ctx.record.stdio, ctx.into.init))
            return
        ctx.output_path = (Path(ctx.request.output_path) if ctx.request.output_path
                           else self._chosen_output(ctx))
        root = ctx.record.processes[0] if ctx.record.processes else None
        owner = (root.uid, root.gid) if root is not None else (ctx.record.uid, ctx.record.uid)
        ctx.inherit_fds = ctx.stdio_fds.enter_context(
            self._stdio.replacements(ctx.record.stdio, ctx.output_path, owner,
                                     bool(ctx.request.output_path))
        )

    def _chosen_output(self, ctx: RestoreContext) -> Path:
        """The output file ckptd chooses for a restore (when the caller names none)."""
        assert ctx.record is not None
        return self._config.output_dir / f"{ctx.record.id}.{ctx.op_id}.out"

    def _remove_output_record(self, ctx: RestoreContext) -> Undo | None:
        if ctx.into is not None or ctx.request.output_path:
            return None  # the container's stdio, or a file the caller named: left as found
        return RemoveOutput(str(self._chosen_output(ctx)))

    def _undo_stdio(self, ctx: RestoreContext) -> None:
        """Our ends closed; a failed restore leaves no output file of its own: the one ckptd
        chose, still empty (nothing of the tree ran). One the caller named is left as
        found."""
        ctx.stdio_fds.close()
        record = self._remove_output_record(ctx)
        if isinstance(record, RemoveOutput) and ctx.output_path is not None:
            with contextlib.suppress(OSError):
                self.undoer.remove_output(record)

    def _put_back_files(self, ctx: RestoreContext) -> None:
        """Last before CRIU (every refusal is behind us): the captured files as they were at
        the checkpoint, each one's UndoPutBack journaled before its effect exists. Undone
        (each file as found) if CRIU or a later step fails."""
        assert ctx.record is not None and ctx.images_dir is not None
        if not ctx.record.files or self._files is None:
            return
        files = self._files if ctx.into is None else self._files.seen_by(ctx.into.init)
        root = (ctx.into.init, ctx.into.start_time) if ctx.into is not None else (0, 0)
        ctx.files = PutBackAll(files, ctx.record, ctx.undo_log, root,
                               asides=self.parts.asides, made=self._clock.time(),
                               shared_files=self._config.shared_files,
                               launchers=self.launchers(ctx.caller, ctx.record))
        ctx.files.run(ctx.images_dir, ctx.op_id)

    def launchers(self, caller: Caller | None, record: CheckpointRecord) -> tuple[int, ...]:
        """The writers of a captured file that are not other writers of it (``shared_files``
        leaves them out): the process that asked for the restore and its ancestors (a batch
        script, a terminal, ``ckptctl run``: they hand the job its output), and the
        checkpoint's own processes where they still run here with their recorded start time
        (the job itself: a migration's source on this node, the tree of a leave-running
        checkpoint): only processes outside the checkpoint are."""
        own = tuple(p.pid for p in record.processes
                    if p.start_time and self._same_process(p.pid, p.start_time))
        if caller is None or not caller.pid:
            return own
        try:
            return (*own, caller.pid, *self._processes.ancestors(caller.pid))
        except (CkptdError, OSError):
            return own

    def _same_process(self, pid: int, start_time: int) -> bool:
        try:
            return self._processes.status(pid).start_time == start_time
        except (CkptdError, OSError):
            return False

    def _undo_files(self, ctx: RestoreContext) -> None:
        if ctx.files is not None:
            ctx.files.undo()

    def _pin_paths(self, ctx: RestoreContext) -> None:
        """After the put-back (its files are among them), before CRIU: what CRIU will open
        by path held as found with no link followed, where it creates checked."""
        assert ctx.record is not None and ctx.images_dir is not None
        if self._files is None:
            return
        paths = self._criu.restore_paths(ctx.images_dir, ctx.images)
        files = self._files if ctx.into is None else self._files.seen_by(ctx.into.init)
        try:
            ctx.pins = files.pin(paths)
        except OSError as exc:
            raise PathChanged(
                f"cannot restore {ctx.record.id}: {exc.strerror or exc}",
                hint="put the path back as it was at the checkpoint (a directory, not a link) "
                     "or keep the job's files where only root can change the directories",
                checkpoint_id=ctx.record.id) from exc

    @staticmethod
    def _unpin_paths(ctx: RestoreContext) -> None:
        if ctx.pins is not None:
            ctx.pins.close()
            ctx.pins = None

    def check_paths(self, ctx: RestoreContext) -> None:
        """At post-restore (the tree exists, has not run): every restored process holds by
        path only what the paths step pinned, our stdio replacements, or what CRIU itself
        still holds in it then (its log and images in the work and image directories, which
        are root's). Raises PathChanged: CRIU then kills the tree, the recipe undoes the
        rest."""
        if ctx.pins is None or ctx.held is None:
            return
        assert ctx.images_dir is not None
        work_dir = self._config.work_dir / ctx.op_id
        allowed = tuple(i.fd for i in ctx.inherit_fds)
        for pid in ctx.held.pids:
            stray = ctx.pins.stray(pid, allowed, (work_dir, ctx.images_dir))
            if stray:
                raise PathChanged(
                    f"restored pid {pid}'s {stray[0]}, not what the checkpoint names: a "
                    "directory on its way changed while CRIU opened it as root",
                    hint="nothing of the tree ran; find who changes that directory, then "
                         "restore again", pid=pid)

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
            lazy=ctx.lazy,
        )
        try:
            ctx.pid = self._criu.restore(job, _HoldOnPostRestore(self._hooks, self, ctx))
        except CriuFailed as exc:
            self._await_undone(ctx)
            cause = exc.__cause__
            if isinstance(cause, CgroupUnavailable):  # CRIU undid the restore: say why
                raise CgroupUnavailable(f"restore undone: {cause.message}", hint=cause.hint,
                                        pid=cause.pid) from exc
            if isinstance(cause, PathChanged):
                raise PathChanged(f"restore undone: {cause.message}", hint=cause.hint,
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

    def hold_restored(self, ctx: RestoreContext, root_pid: int) -> None:
        """Hold the restored tree rooted at ``root_pid`` (a pid on this node), and journal
        its KillTree: at post-restore, before it runs."""
        if ctx.held is not None or root_pid <= 0:
            return
        ctx.held = HeldTree(self._processes)
        try:
            tree = self._processes.tree(root_pid)
        except CkptdError:
            log.warning("restored root pid %d is already gone", root_pid)
            return
        ctx.restored = tuple(ctx.held.hold_facts(tree))
        record = self._kill_tree_record(ctx)
        if ctx.undo_log is not None and record is not None:
            ctx.undo_log.record("criu-restore", record)

    @staticmethod
    def _kill_tree_record(ctx: RestoreContext) -> Undo | None:
        """KillTree of the restored processes, once they are held (a group member: only
        while it is still stopped, its group never having let it run)."""
        if ctx.held is None or ctx.record is None:
            return None
        # a lazy restore's page daemon last: no task may leave a fault once it is gone
        helper = ((ctx.lazy.helper[0], ctx.lazy.helper[1]),) if ctx.lazy and ctx.lazy.helper \
            else ()
        return KillTree((*((p, s) for p, s in ctx.held.members()), *helper),
                        only_stopped=ctx.gate is not None)

    def _kill_restored(self, ctx: RestoreContext) -> None:
        """criu-restore's undo: the restored tree killed (the record's KillTree, in-process:
        a failure comes before anything let the tree run, so every process is killed).
        Nothing when CRIU itself failed: it killed what it had created."""
        if ctx.held is None or not ctx.pid:
            return
        self.undoer.kill_tree(ctx.held)

    def _gate(self, ctx: RestoreContext) -> None:
        """Group restores only: hold the stopped tree until every member is restored."""
        if ctx.gate is None:
            return
        assert ctx.record is not None
        ctx.gate(ctx.pid)
        if ctx.record.gpu is None:  # a CUDA tree runs once its CUDA is back (gpu-restore)
            self._let_run(ctx)

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

        self._gpu.resume(session, ctx.gpu_map, cont=cont)  # failing: criu-restore's undo
        self._let_run(ctx)  # CUDA is back: now the whole tree runs

    @staticmethod
    def _let_run(ctx: RestoreContext) -> None:
        """The whole restored tree SIGCONTed: from now on it runs, so nothing of the restore
        is undone, by a restart either (the journal entry ends)."""
        if ctx.held is not None:
            ctx.held.signal_all(signal.SIGCONT)
        if ctx.undo_log is not None:
            ctx.undo_log.end(done=True)


class _HoldOnPostRestore(ForwardingHooks):
    """The recipe's hooks, plus: CRIU placed in the tree's cgroup before it begins; the
    restored tree held and checked at ``post_restore``, when it exists and has not run yet
    (so no pid of it can have been reused by the time it is held)."""

    def __init__(self, inner: CriuHooks, recipe: RestoreRecipe, ctx: RestoreContext) -> None:
        super().__init__(inner)
        self._recipe = recipe
        self._ctx = ctx

    def criu_started(self, criu_pid: int) -> None:
        self._recipe.place_criu(self._ctx, criu_pid)
        super().criu_started(criu_pid)

    def post_restore(self, pid: int) -> None:
        self._recipe.hold_restored(self._ctx, pid)
        self._recipe.check_placed(self._ctx)
        self._recipe.check_paths(self._ctx)
        super().post_restore(pid)
