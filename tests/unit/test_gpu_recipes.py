"""CUDA processes through the dump and restore recipes, driven by FakeGpu: every branch, and
after every failure each process is back to RUNNING (never left locked or checkpointed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.gpu import GpuSteps
from ckptd.domain import CudaState, GpuInfo, PidState, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import (
    CriuFailed,
    GpuFailed,
    GpuMismatch,
    GpuUnavailable,
    PreconditionFailed,
    StoreError,
)
from ckptd.testing import FakeGpu

from .world import JOB, JOB_TREE, World, make_world

GIB = 1 << 30


@pytest.fixture
def gw(tmp_path: Path) -> World:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    world.gpu.add_cuda_process(1000, 3 * GIB)
    world.gpu.add_cuda_process(1002, 1 * GIB)
    return world


def gpu(w: World) -> FakeGpu:
    assert w.gpu is not None
    return w.gpu


def states(w: World, *pids: int) -> list[CudaState | None]:
    return [gpu(w).cuda_state(p) for p in pids]


def gpu_events(w: World) -> list[str]:
    return [e for e in w.events if e.startswith("gpu.") or e.startswith("criu.dump")]


def test_every_cuda_process_is_locked_and_checkpointed_before_criu(gw: World) -> None:
    record = gw.dump(JOB, leave_running=True)
    events = gpu_events(gw)
    first_criu = next(i for i, e in enumerate(events) if e.startswith("criu.dump"))
    before = events[:first_criu]
    assert before == [
        "gpu.lock 1000", "gpu.lock 1002", "gpu.checkpoint 1000", "gpu.checkpoint 1002",
    ]
    assert record.gpu is not None
    assert record.gpu.cuda_pids == (1000, 1002)
    assert {(u.pid, u.memory) for u in record.gpu.uses} == {(1000, 3 * GIB), (1002, GIB)}
    assert record.gpu.gpus and record.gpu.gpus[0].name.startswith("NVIDIA H100")
    assert record.gpu.checkpoint_s > 0 and record.gpu.lock_s > 0
    # leave-running: CUDA is back right after CRIU's dump
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert gpu(gw).lock_timeouts[1000] == 1000


def test_non_cuda_processes_are_never_touched(gw: World) -> None:
    gw.dump(JOB, leave_running=True)
    assert all(pid != 1001 for m, pid in gpu(gw).calls if m != "uses_cuda")


def test_a_tree_without_cuda_has_no_gpu_facts(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    record = world.dump(JOB, leave_running=True)
    assert record.gpu is None
    assert [m for m, _ in gpu(world).calls if m != "uses_cuda"] == []


def test_without_leave_running_the_tree_dies_checkpointed_after_the_commit(gw: World) -> None:
    gw.dump(JOB)
    assert [m for m, _ in gpu(gw).calls if m in ("restore", "unlock")] == []
    assert gw.states(*JOB_TREE) == ["free"] * 3


def test_lock_timeout_unlocks_those_already_locked(gw: World) -> None:
    gpu(gw).fail_lock_timeout.add(1002)
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert info.value.code == "CUDA_ERROR_NOT_READY"
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert gw.store.list() == []
    assert gw.criu.dump_jobs == []  # CRIU never ran
    assert gw.states(*JOB_TREE) == ["running"] * 3


def test_illegal_state_while_the_target_initializes_is_retried(gw: World) -> None:
    gpu(gw).fail_illegal_state_once.add(1000)
    record = gw.dump(JOB, leave_running=True)
    assert record.gpu is not None
    assert [p for m, p in gpu(gw).calls if m == "lock"] == [1000, 1000, 1002]


def test_checkpoint_failure_in_the_middle_of_the_tree_rolls_everything_back(gw: World) -> None:
    gpu(gw).fail_checkpoint.add(1002)
    with pytest.raises(GpuFailed):
        gw.dump(JOB)
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    # newest first: 1002 (only locked) is unlocked, then 1000 (checkpointed) restored+unlocked
    undo = [e for e in gw.events if e.startswith(("gpu.restore", "gpu.unlock"))]
    assert undo == ["gpu.unlock 1002", "gpu.restore 1000", "gpu.unlock 1000"]
    assert gw.store.list() == []


def test_criu_failure_resumes_the_tree_before_cuda(gw: World) -> None:
    gw.criu.fail_dump = CriuFailed("CRIU dump failed: boom")
    with pytest.raises(CriuFailed):
        gw.dump(JOB)
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert gw.states(*JOB_TREE) == ["running"] * 3


def test_commit_failure_after_a_killing_dump_resumes_tree_then_cuda(gw: World) -> None:
    gw.store.fail_commit = StoreError("disk full")
    with pytest.raises(StoreError):
        gw.dump(JOB)
    assert gw.states(*JOB_TREE) == ["running"] * 3
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    sigcont = next(i for i, e in enumerate(gw.events) if "SIGCONT" in e)
    restore = next(i for i, e in enumerate(gw.events) if e.startswith("gpu.restore"))
    assert sigcont < restore, gw.events


def test_a_restore_failure_during_rollback_still_unlocks_the_others(gw: World) -> None:
    gpu(gw).fail_checkpoint.add(1002)
    gpu(gw).fail_restore.add(1000)
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB)
    assert "rollback" in " ".join(getattr(info.value, "__notes__", []))
    assert states(gw, 1002) == [CudaState.RUNNING]


@pytest.mark.parametrize(
    "message",
    ["driver CUDA 12.4 lacks the checkpoint API: needs r570 / CUDA 12.8",
     "cuCheckpointProcessLock not found in libcuda.so.1"],
)
def test_unavailable_driver_refuses_and_leaves_the_tree_running(gw: World, message: str) -> None:
    gpu(gw).unavailable = message
    # a CUDA process still holding its GPU is seen as CUDA; every call then fails clearly
    with pytest.raises(GpuUnavailable, match=message.split(":", 1)[0]):
        gw.dump(JOB, leave_running=True)
    assert gw.store.list() == []
    assert gw.states(*JOB_TREE) == ["running"] * 3


def test_dump_and_restore_round_trip(gw: World) -> None:
    record = gw.dump(JOB)
    outcome = gw.restore(checkpoint_id=record.id)
    assert outcome.pid == JOB
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert gpu(gw).restore_maps[1000] is None  # same GPUs: no remap
    events = gw.events
    assert events.index(f"criu.restored {JOB}") < events.index("gpu.restore 1000")


def test_restore_onto_other_gpus_of_the_same_model_remaps(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    fake = gpu(world)
    old = fake.gpus[0]
    fake.add_cuda_process(1000, GIB)
    record = world.dump(JOB)
    new = GpuInfo(0, old.name, "GPU-11111111-2222-3333-4444-555555555555", old.memory_total)
    fake.gpus = [new]
    world.restore(checkpoint_id=record.id)
    assert fake.restore_maps[1000] == {old.uuid: new.uuid}
    assert fake.cuda_state(1000) is CudaState.RUNNING


def test_restore_refuses_another_model_before_touching_anything(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    fake = gpu(world)
    fake.add_cuda_process(1000, GIB)
    record = world.dump(JOB)
    fake.gpus = [GpuInfo(0, "NVIDIA A100-SXM4-80GB", "GPU-99999999-0000-0000-0000-000000000000",
                         80 * GIB)]
    world.criu.restore_jobs.clear()
    with pytest.raises(GpuMismatch, match="GPU model or count differs"):
        world.restore(checkpoint_id=record.id)
    assert world.criu.restore_jobs == []
    assert world.states(*JOB_TREE) == ["free"] * 3


def test_a_cuda_restore_failure_kills_the_restored_tree(gw: World) -> None:
    record = gw.dump(JOB)
    gpu(gw).fail_restore.add(1002)
    with pytest.raises(GpuFailed):
        gw.restore(checkpoint_id=record.id)
    assert all(s in ("free", "zombie") for s in gw.states(*JOB_TREE))


def test_restore_needs_gpu_support(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    gpu(world).add_cuda_process(1000, GIB)
    record = world.dump(JOB)
    # the same node, the daemon restarted without GPU support
    world.restore_recipe._gpu = GpuSteps(None, None, world.clock, 1000)
    with pytest.raises(GpuUnavailable, match="no GPU support"):
        world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id))


def test_recovery_brings_cuda_back_to_running(gw: World) -> None:
    fake = gpu(gw)
    # a daemon killed after gpu-checkpoint: CUDA checkpointed, tree running, nothing committed
    fake.lock(1000, 1000)
    fake.checkpoint(1000)
    fake.lock(1002, 1000)
    gw.journal.begin(
        "ck-20260101T000000-aaaaaa",
        {"op": "dump", "checkpoint_id": "ck-20260101T000000-aaaaaa", "pids": list(JOB_TREE),
         "stopped_before": [], "leave_running": False, "cuda_pids": [1000, 1002]},
    )
    gw.processes.processes[1000].state = PidState.STOPPED
    done = gw.new_service().recover()
    assert done and "rolled back" in done[0]
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert gw.states(*JOB_TREE) == ["running"] * 3


# ---- issue #15 ---------------------------------------------------------------------------------


def h100(i: int, base: str) -> GpuInfo:
    return GpuInfo(i, "NVIDIA H100 80GB HBM3", f"GPU-{base}{i:07d}-0000-0000-0000-000000000000",
                   80 * GIB, 80 * GIB)


def test_a_job_on_gpu0_of_an_eight_gpu_node_restores_onto_another_such_node(
    tmp_path: Path,
) -> None:
    """The driver needs a pair for every GPU of the dumping node: the job used one, the
    record keeps all eight, the restore passes eight pairs (FakeGpu refuses fewer)."""
    world = make_world(tmp_path, gpu=True)
    fake = gpu(world)
    fake.gpus = [h100(i, "a") for i in range(8)]
    fake.add_cuda_process(1000, GIB)  # on GPU 0 only
    record = world.dump(JOB)
    assert record.gpu is not None
    assert [g.uuid for g in record.gpu.node_gpus] == [g.uuid for g in fake.gpus]
    assert [g.uuid for g in record.gpu.gpus] == [fake.gpus[0].uuid]
    old = [g.uuid for g in fake.gpus]
    fake.gpus = [h100(i, "b") for i in range(8)]  # another node of eight
    world.restore(checkpoint_id=record.id)
    assert fake.restore_maps[1000] == dict(zip(old, [g.uuid for g in fake.gpus], strict=True))
    assert fake.cuda_state(1000) is CudaState.RUNNING


def test_a_record_round_trips_the_node_gpus_and_old_records_still_read(gw: World) -> None:
    record = gw.dump(JOB)
    assert record.gpu is not None
    assert [g.uuid for g in record.gpu.node_gpus] == [g.uuid for g in gpu(gw).gpus]
    again = type(record).from_json(record.to_json())
    assert again.gpu == record.gpu
    legacy = record.to_json()
    del legacy["gpu"]["node_gpus"]  # written before issue #15
    old = type(record).from_json(legacy)
    assert old.gpu is not None and old.gpu.node_gpus == ()


def test_a_remap_the_checkpointer_cannot_do_is_refused_before_criu(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    fake = gpu(world)
    fake.add_cuda_process(1000, GIB)
    record = world.dump(JOB)
    fake.gpus = [h100(0, "c")]
    fake.remap_refused = "cuda-bindings 13.3.0 lacks CUcheckpointRestoreArgs"
    world.criu.restore_jobs.clear()
    with pytest.raises(GpuMismatch, match=r"the GPUs differ and cuda-bindings 13\.3\.0 lacks"):
        world.restore(checkpoint_id=record.id)
    assert world.criu.restore_jobs == []
    assert [m for m, _ in fake.calls if m == "restore"] == []


def test_a_stopped_cuda_process_is_refused_at_inspect(gw: World) -> None:
    gw.processes.processes[1002].state = PidState.STOPPED
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert "CUDA process 1002 of the tree is stopped" in info.value.message
    assert info.value.pid == 1002 and "kill -CONT 1002" in info.value.hint
    assert [m for m, _ in gpu(gw).calls if m == "lock"] == []


def test_a_negative_lock_timeout_is_refused(gw: World) -> None:
    with pytest.raises(ValueError, match="negative"):
        GpuSteps(gpu(gw), gpu(gw), gw.clock, -1)


# ---- issue 23: what the driver refuses, refused at inspect --------------------------------


@pytest.mark.parametrize("state", [CudaState.LOCKED, CudaState.CHECKPOINTED])
def test_a_process_its_owner_locked_or_checkpointed_is_left_as_it_was(
    gw: World, state: CudaState
) -> None:
    gpu(gw).cuda[1002].state = state
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert f"pid 1002: its CUDA state is already {state.name}" in info.value.message
    assert info.value.pid == 1002
    assert [m for m, _ in gpu(gw).calls if m in ("lock", "restore", "unlock")] == []
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, state], "the owner's state is kept"


def test_a_process_the_driver_left_failed_is_refused_not_skipped(gw: World) -> None:
    gpu(gw).cuda[1000].state = CudaState.FAILED
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert "pid 1000: the job's CUDA state is lost" in info.value.message
    assert [m for m, _ in gpu(gw).calls if m in ("lock", "checkpoint")] == []
    assert states(gw, 1000, 1002) == [CudaState.FAILED, CudaState.RUNNING]


# ---- issue 23 (5) ----------------------------------------------------------------------------


def test_a_failed_cuda_undo_keeps_the_journal_entry_for_the_next_start(gw: World) -> None:
    """The rollback cannot restore 1000: the entry is not ended, so a restart retries it."""
    gpu(gw).fail_checkpoint.add(1002)
    gpu(gw).fail_restore.add(1000)
    with pytest.raises(GpuFailed):
        gw.dump(JOB)
    assert states(gw, 1000) == [CudaState.CHECKPOINTED]
    assert len(list(gw.journal.pending())) == 1, "kept for the next start"
    gpu(gw).fail_restore.clear()  # the driver recovers; the daemon restarts
    done = gw.new_service().recover()
    assert done and "rolled back" in done[0]
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert list(gw.journal.pending()) == []
    assert gw.store.list() == []


def test_leave_running_commits_before_resuming_cuda(gw: World) -> None:
    gw.dump(JOB, leave_running=True)
    commit = next(i for i, e in enumerate(gw.events) if e.startswith("store.commit"))
    resume = next(i for i, e in enumerate(gw.events) if e.startswith("gpu.restore"))
    assert commit < resume, gw.events
    assert list(gw.journal.pending()) == []


def test_leave_running_a_failed_resume_keeps_the_checkpoint_and_says_so(gw: World) -> None:
    gpu(gw).fail_restore.add(1000)
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    err = info.value
    (record,) = gw.store.list()
    assert err.code == "RESUME_FAILED" and err.checkpoint_id == record.id
    assert f"checkpoint {record.id} of pid {JOB} is committed and kept" in err.message
    assert gw.states(*JOB_TREE) == ["running"] * 3
    assert states(gw, 1000, 1002) == [CudaState.CHECKPOINTED, CudaState.RUNNING]
    assert len(list(gw.journal.pending())) == 1, "the resume is retried at the next start"
    gpu(gw).fail_restore.clear()
    done = gw.new_service().recover()
    assert done and "committed" in done[0]
    assert states(gw, 1000, 1002) == [CudaState.RUNNING, CudaState.RUNNING]
    assert [r.id for r in gw.store.list()] == [record.id], "the checkpoint is kept"
    assert gw.states(*JOB_TREE) == ["running"] * 3


def test_a_process_poisoned_by_a_failed_restore_is_refused_at_the_next_dump(gw: World) -> None:
    gpu(gw).fail_restore.add(1002)
    gpu(gw).poison_restore.add(1002)
    with pytest.raises(GpuFailed):
        gw.dump(JOB, leave_running=True)  # rollback's restore fails: 1002 is FAILED now
    assert states(gw, 1002) == [CudaState.FAILED]
    gpu(gw).fail_restore.clear()
    with pytest.raises(PreconditionFailed, match="pid 1002: the job's CUDA state is lost"):
        gw.dump(JOB, leave_running=True)
