"""Issue 23, point 2 (docs/adr/0019): a leave-running dump, a rollback and a restarted
daemon's recovery keep a CUDA tree stopped until its CUDA state is back, bring CUDA back with
every thread of each CUDA process held but the driver's restore thread, then let the tree go.

``FakeGpu`` watches the fake process table: a CUDA process that runs (not held) while its
CUDA state is checkpointed, or restored but not unlocked, is recorded in ``ran_unrestored``
— what CRIU's CUDA plugin keeps frozen against ("attempting to access a UVM pointer will
crash if we haven't restored the underlying mappings yet")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.core.dump import DumpContext
from ckptd.core.recipe import Step
from ckptd.core.undo import AbortStaging, ResumeCuda, ResumeTree, UndoLog
from ckptd.domain import CheckpointRecord, CudaState, PidState
from ckptd.errors import CkptdError, GpuFailed, StoreError
from ckptd.testing import FakeGpu, FakeThreadHold

from .crashes import Death, Died, dying, step_names
from .world import JOB, JOB_TREE, World, guarded_world, make_world

DUMP_STEPS = step_names()[0]

GIB = 1 << 30
CUDA = (1000, 1002)  # 1001, between them, is a CPU-only child


def with_cuda(world: World) -> World:
    assert world.gpu is not None
    world.gpu.add_cuda_process(1000, 3 * GIB)
    world.gpu.add_cuda_process(1002, 1 * GIB)
    world.processes.watchers.append(
        lambda pid, state: world.events.append(f"state {pid} {state.value}"))
    return world


@pytest.fixture
def gw(tmp_path: Path) -> World:
    return with_cuda(make_world(tmp_path, gpu=True))


def gpu(w: World) -> FakeGpu:
    assert w.gpu is not None
    return w.gpu


def threads(w: World) -> FakeThreadHold:
    assert gpu(w).threads is not None
    return gpu(w).threads  # type: ignore[return-value]


def at(w: World, event: str) -> int:
    return w.events.index(event)


def states_at_commit(w: World) -> list[list[str]]:
    """Wrap the store's commit: the tree's states when it is called, one list per commit."""
    seen: list[list[str]] = []
    commit = w.store.commit

    def spying(record: CheckpointRecord) -> CheckpointRecord:
        seen.append(w.states(*JOB_TREE))
        return commit(record)

    w.store.commit = spying  # type: ignore[method-assign]
    return seen


def settled(w: World) -> None:
    """Every CUDA process RUNNING, nothing held, the whole tree running."""
    assert [gpu(w).cuda_state(p) for p in CUDA] == [CudaState.RUNNING] * 2
    assert threads(w).held == {}
    assert w.states(*JOB_TREE) == ["running"] * 3


# ---- (a) the leave-running dump --------------------------------------------------------------


def test_a_leave_running_dump_keeps_the_tree_stopped_until_its_cuda_is_back(gw: World) -> None:
    """Order: images -> commit -> CUDA back with the tree held -> the tree goes. CRIU's let-go
    finds the tree stopped (a SIGSTOP queued while CRIU still holds it), the commit too; each
    CUDA process runs only its restore thread until restored and unlocked; then all run."""
    seen = states_at_commit(gw)
    record = gw.dump(JOB, leave_running=True)
    assert gpu(gw).ran_unrestored == []
    assert seen == [["stopped"] * 3]
    ev = gw.events
    assert at(gw, f"criu.finished {JOB}") < at(gw, f"store.commit {record.id}")
    assert at(gw, f"store.commit {record.id}") < at(gw, "threads.hold 1000")
    for pid in CUDA:  # held, then continued: only the restore thread runs
        assert at(gw, f"threads.hold {pid}") < at(gw, f"signal {pid} SIGCONT")
        assert at(gw, f"gpu.unlock {pid}") < at(gw, f"threads.release {pid}")
    assert at(gw, "gpu.unlock 1000") < at(gw, "signal 1001 SIGCONT"), ev
    assert [e for e in ev if e.startswith("state 1001")][-1] == "state 1001 running"
    settled(gw)
    assert list(gw.journal.pending()) == []


def test_a_cpu_only_leave_running_dump_is_never_stopped_after_criu(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    seen = states_at_commit(world)
    world.dump(JOB, leave_running=True)
    assert seen == [["running"] * 3]
    assert not any("SIGSTOP" in e or "SIGCONT" in e for e in world.events)


def test_a_failed_cuda_resume_keeps_the_checkpoint_and_never_leaves_the_tree_stopped(
        gw: World) -> None:
    gpu(gw).fail_restore.add(1000)
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    (record,) = gw.store.list()
    assert info.value.code == "RESUME_FAILED" and info.value.checkpoint_id == record.id
    assert "is committed and kept" in info.value.message
    # never left stopped nor held; only the process whose CUDA could not come back ran so
    assert gw.states(*JOB_TREE) == ["running"] * 3 and threads(gw).held == {}
    assert gpu(gw).ran_unrestored == [1000]
    assert [gpu(gw).cuda_state(p) for p in CUDA] == [CudaState.CHECKPOINTED, CudaState.RUNNING]
    assert len(list(gw.journal.pending())) == 1


def test_a_process_that_cannot_be_held_is_let_go_with_the_tree(gw: World) -> None:
    threads(gw).fail_hold.add(1002)
    with pytest.raises(CkptdError, match="cannot hold thread 1002"):
        gw.dump(JOB, leave_running=True)
    assert len(gw.store.list()) == 1
    assert gw.states(*JOB_TREE) == ["running"] * 3 and threads(gw).held == {}
    assert [gpu(gw).cuda_state(p) for p in CUDA] == [CudaState.RUNNING, CudaState.CHECKPOINTED]


# ---- rollbacks -------------------------------------------------------------------------------


def failing_after(w: World, name: str) -> None:
    """Make the dump's step ``name`` fail (a StoreError) once it has done its work."""

    def wrap(step: Step[DumpContext]) -> Step[DumpContext]:
        def do(ctx: DumpContext) -> None:
            step.do(ctx)
            raise StoreError(f"{name} failed")

        return replace(step, do=do) if step.name == name else step

    w.dump_recipe.steps = tuple(wrap(s) for s in w.dump_recipe.steps)


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
@pytest.mark.parametrize("step", ["files", "gate"])
def test_a_rollback_brings_cuda_back_before_the_tree_runs(
        gw: World, step: str, leave_running: bool) -> None:
    """A step after CRIU's dump fails: while CRIU still holds the tree (``files``) its own
    resume finds the tree stopped; after let-go (``gate``, a group giving up) the tree is
    stopped already (leave-running: for its CUDA resume). CUDA comes back held, then the
    tree runs."""
    failing_after(gw, step)
    with pytest.raises(StoreError, match=f"{step} failed"):
        gw.dump(JOB, leave_running=leave_running)
    assert gpu(gw).ran_unrestored == []
    assert gw.store.list() == []
    settled(gw)


# ---- (b) recovery at the next start ----------------------------------------------------------


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
def test_recovery_retries_cuda_with_the_tree_held_then_lets_it_go(
        gw: World, leave_running: bool) -> None:
    """A daemon killed with the tree stopped and its CUDA checkpointed (CRIU done, nothing
    committed): the restart holds the CUDA processes, continues them (their restore threads
    run), restores + unlocks, releases, and only then continues the rest of the tree."""
    fake = gpu(gw)
    for pid in CUDA:
        fake.lock(pid, 1000)
        fake.checkpoint(pid)
    for pid in JOB_TREE:
        gw.processes.processes[pid].state = PidState.STOPPED
    ckpt = "ck-20260101T000000-aaaaaa"
    members = tuple((p, gw.processes.processes[p].start_time) for p in JOB_TREE)
    log = UndoLog(gw.journal, ckpt, "dump", ckpt)
    log.record("stage", AbortStaging(ckpt))
    log.record("gpu-lock", ResumeCuda(tuple(m for m in members if m[0] in CUDA),
                                      unless_committed="" if leave_running else ckpt))
    log.record("criu-dump", ResumeTree(members, (), unless_committed=""
                                       if leave_running else ckpt))
    gw.events.clear()

    done = gw.new_service().recover()

    assert done and "rolled back" in done[0]
    assert fake.ran_unrestored == []
    for pid in CUDA:
        assert at(gw, f"threads.hold {pid}") < at(gw, f"signal {pid} SIGCONT")
        assert at(gw, f"gpu.unlock {pid}") < at(gw, "signal 1001 SIGCONT")
    settled(gw)


def test_recovery_of_a_cuda_process_stopped_before_leaves_it_stopped(gw: World) -> None:
    """A process stopped before the dump stays stopped (ResumeTree's ``stopped_before``),
    even as a CUDA one: it is not continued for its CUDA resume."""
    fake = gpu(gw)
    fake.lock(1002, 1000)
    fake.checkpoint(1002)
    gw.processes.processes[1002].state = PidState.STOPPED
    ckpt = "ck-20260101T000000-bbbbbb"
    members = tuple((p, gw.processes.processes[p].start_time) for p in JOB_TREE)
    log = UndoLog(gw.journal, ckpt, "dump", ckpt)
    log.record("gpu-lock", ResumeCuda(((1002, members[2][1]),)))
    log.record("criu-dump", ResumeTree(members, (1002,)))
    gw.new_service().recover()
    assert gw.states(1002) == ["stopped"]
    assert "signal 1002 SIGCONT" not in gw.events
    assert fake.ran_unrestored == []


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
@pytest.mark.parametrize("step", DUMP_STEPS)
def test_a_cuda_dump_killed_after_any_step(gw: World, step: str, leave_running: bool) -> None:
    """Killed after any step, restarted: no CUDA process ran before its CUDA state was
    back; the tree runs (or, a committed killing dump, is killed), nothing held."""
    original = gw.dump_recipe.steps
    gw.dump_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        gw.dump(JOB, leave_running=leave_running)
    gw.dump_recipe.steps = original
    committed = DUMP_STEPS.index(step) >= DUMP_STEPS.index("commit")

    gw.new_service().recover()

    assert gpu(gw).ran_unrestored == []
    assert list(gw.journal.pending()) == []
    if committed and not leave_running:
        assert gw.states(*JOB_TREE) == ["free"] * 3
    else:
        settled(gw)


@pytest.mark.parametrize("step", ["let-go", "gate", "commit", "gpu-resume"])
def test_a_guarded_leave_running_cuda_dump_killed_after_let_go_is_not_left_stopped(
        tmp_path: Path, step: str) -> None:
    """The guard (docs/adr/0016) continues a leave-running tree whatever the phase (after
    let-go a CUDA tree is stopped for its CUDA resume): the tree runs at once; the restart
    then brings its CUDA back (held: the guard cannot, only a daemon has the driver)."""
    world, guard = guarded_world(tmp_path, gpu=True)
    with_cuda(world)
    original = world.dump_recipe.steps
    world.dump_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        world.dump(JOB, leave_running=True)
    world.dump_recipe.steps = original
    guard.watch.daemon_gone()
    assert world.states(*JOB_TREE) == ["running"] * 3
    world.new_service().recover()
    settled(world)
    assert len(world.store.list()) == (0 if step in ("let-go", "gate") else 1)
