"""A small fake node: every port faked, the recipes and the service wired over them.

Processes of the base table::

    1     init       uid 0
    2     kthreadd   uid 0, kernel thread
    3     kworker    uid 0, kernel thread (child of 2)
    50    sshd       uid 0            the daemon's parent
    100   ckptd      uid 0            the daemon (config.daemon_pid)
    1000  job        uid 1000         USER's job, children 1001, 1002
    2000  other      uid 2000         OTHER's job, child 2001
    3000  mixed      uid 1000         child 3001 owned by uid 2000

Cgroups (``world.cgroups``): every process of the table in ``DAEMON_CGROUP``; the callers
``USER`` and ``OTHER`` (processes of no table) in ``USER_CGROUP`` and ``OTHER_CGROUP``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.core.config import CoreConfig
from ckptd.core.dump import DumpRecipe
from ckptd.core.gpu import GpuSteps
from ckptd.core.guard import TreeWatch, Verdict
from ckptd.core.parts import RecipeParts
from ckptd.core.ports import CriuHooks, GuardPhase
from ckptd.core.restore import RestoreRecipe
from ckptd.core.service import CheckpointService
from ckptd.core.undo import with_guard_resumed
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CriuStatus,
    DumpRequest,
    NodeReport,
    RestoreOutcome,
    RestoreRequest,
)
from ckptd.domain.model import ROOT
from ckptd.testing import (
    FakeCgroups,
    FakeClock,
    FakeCriu,
    FakeGpu,
    FakeJobFiles,
    FakeNodeInspector,
    FakeProcessTable,
    FakeStdioProvider,
    FakeThreadHold,
    MemoryJournal,
    MemoryStore,
)
from ckptd.testing._asides import FakeAsideLog

DAEMON_PID = 100
DAEMON_PARENT = 50
USER = Caller(uid=1000, pid=777)
OTHER = Caller(uid=2000, pid=778)
JOB = 1000
JOB_TREE = (1000, 1001, 1002)
OTHER_JOB = 2000
MIXED_JOB = 3000
DAEMON_CGROUP = "/system.slice/ckptd.service"
USER_CGROUP = "/user.slice/user-1000.slice/session-4.scope"
OTHER_CGROUP = "/slurm/job_42/step_0"


class ProgrammableHooks(CriuHooks):
    """CriuHooks whose methods call ``on[name](pid)`` when set."""

    def __init__(self) -> None:
        self.on: dict[str, Callable[[int], None]] = {}

    def _call(self, name: str, pid: int) -> None:
        hook = self.on.get(name)
        if hook is not None:
            hook(pid)

    def pre_dump(self, pid: int) -> None:
        self._call("pre_dump", pid)

    def network_lock(self, pid: int) -> None:
        self._call("network_lock", pid)

    def post_dump(self, pid: int) -> None:
        self._call("post_dump", pid)

    def network_unlock(self, pid: int) -> None:
        self._call("network_unlock", pid)

    def pre_restore(self, pid: int) -> None:
        self._call("pre_restore", pid)

    def setup_namespaces(self, pid: int) -> None:
        self._call("setup_namespaces", pid)

    def post_restore(self, pid: int) -> None:
        self._call("post_restore", pid)

    def pre_resume(self, pid: int) -> None:
        self._call("pre_resume", pid)

    def post_resume(self, pid: int) -> None:
        self._call("post_resume", pid)


@dataclass
class World:
    tmp: Path
    events: list[str]
    clock: FakeClock
    processes: FakeProcessTable
    criu: FakeCriu
    store: MemoryStore
    journal: MemoryJournal
    stdio: FakeStdioProvider
    hooks: ProgrammableHooks
    config: CoreConfig
    dump_recipe: DumpRecipe
    restore_recipe: RestoreRecipe
    service: CheckpointService
    progress: list[tuple[str, float]] = field(default_factory=list)
    gpu: FakeGpu | None = None
    node: FakeNodeInspector = field(default_factory=FakeNodeInspector)
    files: FakeJobFiles = field(default_factory=FakeJobFiles)
    cgroups: FakeCgroups = field(default_factory=FakeCgroups)

    def dump(
        self, pid: int = JOB, caller: Caller = ROOT, *, leave_running: bool = False,
        name: str = "", labels: dict[str, str] | None = None,
    ) -> CheckpointRecord:
        """A dump through the service, one fake second after the previous operation."""
        self.clock.advance(1.0)
        return self.service.dump(
            caller,
            DumpRequest(pid, leave_running=leave_running, name=name, labels=labels or {}),
            lambda p: self.progress.append((p.stage, p.fraction)),
        )

    def restore(
        self, caller: Caller = ROOT, *, checkpoint_id: str = "", pid: int = 0, name: str = "",
        output_path: str = "", ignore_warnings: bool = False,
    ) -> RestoreOutcome:
        self.clock.advance(1.0)
        return self.service.restore(
            caller,
            RestoreRequest(checkpoint_id=checkpoint_id, pid=pid, name=name,
                           output_path=output_path, ignore_warnings=ignore_warnings),
            lambda p: self.progress.append((p.stage, p.fraction)),
        )

    def new_service(self) -> CheckpointService:
        """Another service over the same fakes (a restarted daemon)."""
        return make_service(self)

    def states(self, *pids: int) -> list[str]:
        return [self.processes.state(p).value for p in pids]


def make_service(w: World) -> CheckpointService:
    return CheckpointService(
        dump=w.dump_recipe,
        restore=w.restore_recipe,
        store=w.store,
        processes=w.processes,
        journal=w.journal,
        clock=w.clock,
        config=w.config,
        probe=lambda: NodeReport("test-node", "6.8", CriuStatus("criu", "4.1", True, "ok")),
        gpu=w.dump_recipe._gpu,
        cgroups=w.cgroups,
    )


def base_processes(processes: FakeProcessTable) -> None:
    processes.add_process(1, 0, comm="init")
    processes.add_process(2, 0, comm="kthreadd", kernel_thread=True)
    processes.add_process(3, 2, comm="kworker/0:1", kernel_thread=True)
    processes.add_process(DAEMON_PARENT, 1, comm="sshd")
    processes.add_process(DAEMON_PID, DAEMON_PARENT, comm="ckptd")
    processes.add_tree(JOB, 1001, 1002, uid=USER.uid, comm="job")
    processes.add_tree(OTHER_JOB, 2001, uid=OTHER.uid, comm="other")
    processes.add_process(MIXED_JOB, 1, comm="mixed", uid=USER.uid)
    processes.add_process(3001, MIXED_JOB, comm="helper", uid=OTHER.uid)
    for pid in list(processes.processes):
        processes.standard_stdio(pid)


def make_world(
    tmp: Path,
    *,
    zombie_wait_s: float = 1.0,
    keep_work_dirs: int = 20,
    gpu: bool = False,
    file_capture_limit: int = 8 << 30,
    file_capture_oversize: str = "refuse",
    jobs_cgroup: str = "/ckptd-jobs",
    place_cgroups: bool = True,
    tcp_outside_peers: str = "restore",
    shared_files: str = "keep",
    aside_keep: int = 3,
    ghost_total_limit: int = CoreConfig.ghost_total_limit,
    ghost_uid_limit: int = CoreConfig.ghost_uid_limit,
    files_dir_max_files: int = CoreConfig.files_dir_max_files,
) -> World:
    """``gpu``: give the daemon GPU support (a ``FakeGpu`` over the world's processes, clock
    and events, as ``world.gpu``); False: a daemon without GPU support. ``place_cgroups``
    False: the restore recipe has no ``Cgroups`` port (a node without cgroup v2)."""
    events: list[str] = []
    clock = FakeClock()
    processes = FakeProcessTable(kill_mode="free", events=events)
    base_processes(processes)
    cgroups = FakeCgroups(processes, default=DAEMON_CGROUP, events=events)
    cgroups.spawn(USER.pid or 0, USER_CGROUP)
    cgroups.spawn(OTHER.pid or 0, OTHER_CGROUP)
    criu = FakeCriu(processes, clock=clock, events=events, cgroups=cgroups)
    store = MemoryStore(tmp / "store", events=events)
    journal = MemoryJournal(events=events)
    stdio = FakeStdioProvider(events=events)
    hooks = ProgrammableHooks()
    config = CoreConfig(
        node="test-node",
        daemon_pid=DAEMON_PID,
        work_dir=tmp / "work",
        output_dir=tmp / "out",
        zombie_wait_s=zombie_wait_s,
        keep_work_dirs=keep_work_dirs,
        file_capture_limit=file_capture_limit,
        file_capture_oversize=file_capture_oversize,
        jobs_cgroup=jobs_cgroup,
        tcp_outside_peers=tcp_outside_peers,
        shared_files=shared_files,
        aside_keep=aside_keep,
        ghost_total_limit=ghost_total_limit,
        ghost_uid_limit=ghost_uid_limit,
        files_dir_max_files=files_dir_max_files,
    )
    files = FakeJobFiles(events=events)
    threads = FakeThreadHold(processes, events=events)
    fake_gpu = (FakeGpu(processes=processes, clock=clock, events=events, threads=threads,
                        cgroups=cgroups) if gpu else None)
    gpu_steps = GpuSteps(fake_gpu, fake_gpu, clock, lock_timeout_ms=1000, facts=fake_gpu,
                         threads=threads)
    node = FakeNodeInspector(events=events)
    parts = RecipeParts(
        criu=criu, processes=processes, store=store, journal=journal, clock=clock,
        config=config, hooks=hooks, gpu=gpu_steps, node=node, files=files,
        cgroups=cgroups if place_cgroups else None, asides=FakeAsideLog(),
    )
    dump_recipe = DumpRecipe(replace(parts, cgroups=cgroups))
    restore_recipe = RestoreRecipe(parts, stdio=stdio)
    world = World(
        tmp=tmp, events=events, clock=clock, processes=processes, criu=criu, store=store,
        journal=journal, stdio=stdio, hooks=hooks, config=config, dump_recipe=dump_recipe,
        restore_recipe=restore_recipe, service=None,  # type: ignore[arg-type]
        gpu=fake_gpu, node=node, files=files, cgroups=cgroups,
    )
    world.service = make_service(world)
    return world


# ---- the dump guard in this process (docs/adr/0016) ------------------------------------------


class InProcessGuard:
    """``TreeGuard`` feeding a ``TreeWatch`` in this process (the guard process's loop,
    without the socket); records go into the world's journal as the guard's do."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.calls: list[str] = []
        self.watch = TreeWatch(traced=lambda pid: False, record=self._record, clock=world.clock)

    def _record(self, op_id: str, what: Verdict) -> bool:
        del what
        for pending, facts in self.world.journal.pending():
            if pending == op_id:
                self.world.journal.begin(op_id, with_guard_resumed(facts))
        return True

    def watch_tree(self, op_id: str, members: Sequence[Sequence[int]],
                   stopped_before: frozenset[int], leave_running: bool) -> None:
        self.calls.append(f"watch {len(members)}")
        self.watch.watch(op_id, leave_running, stopped_before)
        handles = [self.world.processes.open(m[0], m[1]) for m in members]
        self.watch.hold(op_id, [h for h in handles if h is not None])

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        self.calls.append(f"phase {phase.value}")
        self.watch.phase(op_id, phase)

    def release(self, op_id: str) -> None:
        self.calls.append("release")
        self.watch.release(op_id)


def guarded_world(tmp_path: Path, *, gpu: bool = False) -> tuple[World, InProcessGuard]:
    world = make_world(tmp_path, gpu=gpu)
    guard = InProcessGuard(world)

    class Port:
        def watch(self, op_id: str, members: Sequence[Sequence[int]],
                  stopped_before: frozenset[int], leave_running: bool) -> None:
            guard.watch_tree(op_id, members, stopped_before, leave_running)

        def phase(self, op_id: str, phase: GuardPhase) -> None:
            guard.phase(op_id, phase)

        def release(self, op_id: str) -> None:
            guard.release(op_id)

    world.dump_recipe._guard = Port()
    return world, guard


def assert_nothing_happened(w: World) -> None:
    """A refused dump touches nothing: no CRIU, no journal, no store, no signal."""
    assert w.criu.dump_jobs == []
    assert w.journal.history == []
    assert w.store.calls == []
    assert w.processes.signals == []
    assert w.store.list() == []
