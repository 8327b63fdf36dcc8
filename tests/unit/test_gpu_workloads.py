"""Issue 23 (6, 9): workloads the CUDA driver cannot checkpoint — NCCL across processes, MIG,
a launch job below r610 — are refused at inspect, before anything is locked or frozen, each
naming the process and what would work; what cannot be seen beforehand (CUDA IPC, UVM) is
the driver's refusal, translated. FakeGpu behaves as the driver does, so the recipes show
what the refusal spares: an NCCL pair hangs the dump without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.gpu import GpuSteps
from ckptd.core.gpu_plan import NCCL_TODO, workload_refusals
from ckptd.core.ports import CudaProcessFact
from ckptd.domain import CudaState, GpuInventory
from ckptd.errors import GpuFailed, PreconditionFailed
from ckptd.testing import H100, FakeGpu

from .world import JOB, World, make_world

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


def states(w: World) -> list[CudaState | None]:
    return [gpu(w).cuda_state(p) for p in (1000, 1002)]


def touched(w: World) -> list[str]:
    """Every event of the dump that locked, checkpointed or froze anything."""
    return [e for e in w.events if e.startswith(("gpu.", "criu.", "freeze", "cgroup.freeze"))]


def without_inspect_refusals(w: World) -> None:
    """The daemon as it was before issue 23 (6): no /proc facts looked at."""
    w.dump_recipe._gpu = GpuSteps(gpu(w), gpu(w), w.clock, 1000, threads=gpu(w).threads)


# ---- NCCL ------------------------------------------------------------------------------------


def test_an_nccl_pair_is_refused_at_inspect_before_anything_is_frozen(gw: World) -> None:
    gpu(gw).nccl |= {1000, 1002}
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    message = info.value.message
    assert "pids 1000, 1002 are 2 CUDA processes of the tree using NCCL" in message
    assert "cuda-checkpoint issue 30" in message and NCCL_TODO in message
    assert "torch.distributed" in message
    assert [m for m, _ in gpu(gw).calls if m in ("lock", "checkpoint")] == []
    assert touched(gw) == []
    assert gpu(gw).hung == []
    assert states(gw) == [CudaState.RUNNING, CudaState.RUNNING]


def test_without_the_inspect_refusal_the_fake_nccl_pair_hangs_the_dump(gw: World) -> None:
    """What the refusal spares (cuda-checkpoint issue 30): 1000 locked, 1002's lock waits
    for a collective that never ends until it times out; the dump fails late."""
    gpu(gw).nccl |= {1000, 1002}
    without_inspect_refusals(gw)
    started = gw.clock.monotonic()
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert info.value.pid == 1002
    assert "its NCCL peer 1000 is locked" in info.value.message
    assert gpu(gw).hung == [1002]
    assert gw.clock.monotonic() - started >= 1.0, "the lock waited out its timeout"
    assert states(gw) == [CudaState.RUNNING, CudaState.RUNNING], "the rollback unlocked 1000"


def test_the_fake_nccl_rank_hangs_to_the_adapter_bound_without_a_lock_timeout() -> None:
    fake = FakeGpu()
    fake.add_cuda_process(10)
    fake.add_cuda_process(11)
    fake.nccl |= {10, 11}
    fake.lock(10, 0)
    with pytest.raises(GpuFailed) as info:
        fake.lock(11, 0)
    assert info.value.code == "TIMEOUT"
    assert fake.cuda_state(11) is CudaState.RUNNING
    fake.unlock(10)
    fake.lock(11, 0)  # no peer held: no hang
    assert fake.cuda_state(11) is CudaState.LOCKED


def test_one_process_with_nccl_is_not_refused(gw: World) -> None:
    gpu(gw).nccl.add(1000)
    record = gw.dump(JOB, leave_running=True)
    assert record.gpu is not None and record.gpu.cuda_pids == (1000, 1002)


# ---- MIG -------------------------------------------------------------------------------------


def test_a_process_on_a_mig_gpu_is_refused_at_inspect(gw: World) -> None:
    gpu(gw).mig.add(H100.uuid)
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    message = info.value.message
    assert f"pid 1000: uses GPU 0 ({H100.uuid}) in MIG mode" in message
    assert f"pid 1002: uses GPU 0 ({H100.uuid}) in MIG mode" in message
    assert "cuda-checkpoint issue 42" in message and "MIG disabled" in message
    assert touched(gw) == []


def test_without_the_inspect_refusal_the_fake_refuses_mig_at_lock(gw: World) -> None:
    gpu(gw).mig.add(H100.uuid)
    gw.dump_recipe._gpu = GpuSteps(gpu(gw), gpu(gw), gw.clock, 1000)
    gpu(gw).inventory = lambda: GpuInventory(  # type: ignore[method-assign]
        True, "no MIG seen", driver_version="580.159.03", cuda_version=13000, gpus=(H100,)
    )
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert info.value.code == "CUDA_ERROR_NOT_SUPPORTED"
    assert "MIG" in info.value.message and "MIG disabled" in info.value.hint
    assert states(gw) == [CudaState.RUNNING, CudaState.RUNNING]


# ---- launch jobs and CUDA IPC ------------------------------------------------------------------


def test_a_launch_job_below_r610_is_refused_at_inspect(gw: World) -> None:
    gpu(gw).launch_jobs[1002] = "/run/job.json"
    with pytest.raises(PreconditionFailed) as info:
        gw.dump(JOB, leave_running=True)
    message = info.value.message
    assert "pid 1002: was started as a cuda-checkpoint launch job" in message
    assert "CUDA_CHECKPOINT_JOB_FILE=/run/job.json" in message
    assert "needs driver r610 (this node has 580.159.03)" in message
    assert touched(gw) == []


def test_a_launch_job_with_ipc_on_r610_is_checkpointed(gw: World) -> None:
    gpu(gw).driver_version = "610.10"
    gpu(gw).launch_jobs[1002] = "/run/job.json"
    gpu(gw).ipc.add(1002)
    record = gw.dump(JOB, leave_running=True)
    assert record.gpu is not None and record.gpu.cuda_pids == (1000, 1002)


def test_cuda_ipc_is_the_drivers_refusal_translated(gw: World) -> None:
    """/proc cannot show CUDA IPC: the dump gets as far as the driver's checkpoint, whose
    NOT_SUPPORTED is said in words, with what would work; everything is rolled back."""
    gpu(gw).ipc.add(1002)
    with pytest.raises(GpuFailed) as info:
        gw.dump(JOB, leave_running=True)
    assert info.value.code == "CUDA_ERROR_NOT_SUPPORTED" and info.value.pid == 1002
    assert "CUDA IPC memory shared with another process" in info.value.message
    assert "r610" in info.value.hint and "--launch-job" in info.value.hint
    assert states(gw) == [CudaState.RUNNING, CudaState.RUNNING]


# ---- the decision, pure ------------------------------------------------------------------------


def inventory(driver: str = "580.159.03", mig: tuple[str, ...] = ()) -> GpuInventory:
    return GpuInventory(True, "", driver_version=driver, cuda_version=13000, gpus=(H100,),
                        mig_enabled=mig)


def test_workload_refusals_one_line_each() -> None:
    facts = [
        CudaProcessFact(1, nccl=True, launch_job="/j"),
        CudaProcessFact(2, nccl=True),
        CudaProcessFact(3),
    ]
    used = {1: {H100.uuid}, 2: {H100.uuid}, 3: set[str]()}
    lines = workload_refusals(facts, inventory(mig=(H100.uuid,)), used)
    assert len(lines) == 4
    assert lines[0].startswith("pids 1, 2 are 2 CUDA processes of the tree using NCCL")
    assert lines[1].startswith("pid 1: uses GPU 0") and lines[2].startswith("pid 2: uses GPU 0")
    assert lines[3].startswith("pid 1: was started as a cuda-checkpoint launch job")


def test_workload_refusals_let_go_what_the_driver_takes() -> None:
    facts = [CudaProcessFact(1, nccl=True, launch_job="/j"), CudaProcessFact(2)]
    used = {1: {H100.uuid}, 2: {H100.uuid}}
    assert workload_refusals(facts, inventory(driver="610.1"), used) == []
    assert workload_refusals(facts, inventory(driver="?"), used) == []  # unknown driver
    unread = [CudaProcessFact(1, unreadable="gone"), CudaProcessFact(2, unreadable="gone")]
    assert workload_refusals(unread, inventory(), used) == []


def test_proc_maps_and_environ_parsing() -> None:
    from ckptd.adapters.procfs.cudafacts import job_file, maps_nccl

    torch = (
        b"7f00-7f10 r-xp 00000000 08:01 42   /opt/venv/lib/python3.12/site-packages/nvidia/"
        b"nccl/lib/libnccl.so.2\n"
    )
    bundled = b"7f00-7f10 r-xp 00000000 08:01 42  /x/torch/lib/libnccl-bd7a1b4b.so.2 (deleted)\n"
    other = (
        b"7f00-7f10 rw-s 00000000 00:05 9   /dev/nvidia-uvm\n"
        b"7f00-7f10 r-xp 00000000 08:01 7   /usr/lib/libcuda.so.1\n"
        b"7f00-7f10 r-xp 00000000 08:01 7   /home/me/libncclx/notnccl.so\n"
        b"7f00-7f10 rw-p 00000000 00:00 0 \n"
    )
    assert maps_nccl(torch) and maps_nccl(other + bundled)
    assert not maps_nccl(other)
    assert job_file(b"A=1\0CUDA_CHECKPOINT_JOB_FILE=/j\0B=2\0") == "/j"
    assert job_file(b"XCUDA_CHECKPOINT_JOB_FILE=/j\0") == ""
