"""``FakeGpu``: the driver's state machine, memory accounting, remapping, failure injection."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from ckptd.core import ports
from ckptd.domain import CudaState, GpuUse
from ckptd.errors import GpuFailed, GpuUnavailable
from ckptd.testing import H100, FakeClock, FakeGpu, FakeProcessTable

PID = 5001
GIB = 2**30
SECOND = replace(H100, index=1, uuid="GPU-11111111-2222-3333-4444-555555555555",
                 pci_bus_id="00000000:75:00.0")
A100 = replace(H100, index=2, name="NVIDIA A100-SXM4-80GB",
               uuid="GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", compute_capability="8.0")

METHODS = ("lock", "checkpoint", "restore", "unlock")


def call(gpu: FakeGpu, method: str, pid: int = PID) -> None:
    if method == "lock":
        gpu.lock(pid, 1000)
    else:
        getattr(gpu, method)(pid)


def gpu_in(state: CudaState) -> FakeGpu:
    gpu = FakeGpu()
    gpu.add_cuda_process(PID, 4 * GIB, state=state)
    return gpu


def test_fits_both_ports() -> None:
    gpu = FakeGpu()
    for protocol in (ports.GpuInventoryPort, ports.GpuCheckpointer):
        for name, member in vars(protocol).items():
            if name.startswith("_") or not callable(member):
                continue
            want = list(inspect.signature(member).parameters)[1:]
            assert list(inspect.signature(getattr(gpu, name)).parameters) == want, name


def test_default_inventory() -> None:
    gpu = FakeGpu()
    gpu.add_cuda_process(PID, 4 * GIB)
    inv = gpu.inventory()
    assert inv.available
    assert inv.driver_version == "580.159.03" and inv.cuda_version == 13000
    (only,) = inv.gpus
    assert only.name == "NVIDIA H100 80GB HBM3"
    assert only.uuid == H100.uuid and only.uuid.startswith("GPU-")
    assert only.compute_capability == "9.0"
    assert only.memory_free == only.memory_total - 4 * GIB
    assert inv.uses == (GpuUse(PID, H100.uuid, 4 * GIB),)


def test_full_cycle() -> None:
    events: list[str] = []
    clock = FakeClock()
    gpu = FakeGpu(events=events, clock=clock)
    gpu.add_cuda_process(PID, 4 * GIB)
    start = clock.monotonic()
    assert gpu.uses_cuda(PID)
    assert gpu.state(PID) is CudaState.RUNNING
    gpu.lock(PID, 7000)
    assert gpu.state(PID) is CudaState.LOCKED
    gpu.checkpoint(PID)
    assert gpu.state(PID) is CudaState.CHECKPOINTED
    assert gpu.inventory().uses == (), "a checkpointed process holds no device memory"
    assert gpu.inventory().gpus[0].memory_free == H100.memory_total
    gpu.restore(PID)
    assert gpu.state(PID) is CudaState.LOCKED
    gpu.unlock(PID)
    assert gpu.state(PID) is CudaState.RUNNING
    assert gpu.inventory().uses == (GpuUse(PID, H100.uuid, 4 * GIB),)
    assert events == [f"gpu.{m} {PID}" for m in METHODS]
    assert [m for m, _ in gpu.calls] == [
        "uses_cuda", "state", "lock", "state", "checkpoint", "state", "restore", "state",
        "unlock", "state",
    ]
    assert gpu.lock_timeouts == {PID: 7000}
    assert gpu.restore_maps == {PID: None}
    assert clock.monotonic() - start == pytest.approx(sum(gpu.durations.values()))


LEGAL = {
    (CudaState.RUNNING, "lock"): CudaState.LOCKED,
    (CudaState.LOCKED, "checkpoint"): CudaState.CHECKPOINTED,
    (CudaState.CHECKPOINTED, "restore"): CudaState.LOCKED,
    (CudaState.LOCKED, "unlock"): CudaState.RUNNING,
}


@pytest.mark.parametrize("state", list(CudaState))
@pytest.mark.parametrize("method", METHODS)
def test_state_machine(state: CudaState, method: str) -> None:
    gpu = gpu_in(state)
    after = LEGAL.get((state, method))
    if after is not None:
        call(gpu, method)
        assert gpu.state(PID) is after
        return
    with pytest.raises(GpuFailed) as info:
        call(gpu, method)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert info.value.pid == PID
    assert info.value.call.startswith("cuCheckpointProcess")
    assert gpu.state(PID) is state, "a refused call changes nothing"


def test_lock_timeout_leaves_the_process_running() -> None:
    events: list[str] = []
    gpu = FakeGpu(events=events)
    gpu.add_cuda_process(PID)
    gpu.fail_lock_timeout.add(PID)
    with pytest.raises(GpuFailed) as info:
        gpu.lock(PID, 250)
    assert info.value.code == "CUDA_ERROR_NOT_READY"
    assert info.value.message.startswith(
        f"cuCheckpointProcessLock for pid {PID} failed: CUDA_ERROR_NOT_READY"
    )
    assert gpu.state(PID) is CudaState.RUNNING
    assert events == [f"gpu.lock-failed {PID}"]
    gpu.lock_timeout_code = "CUDA_ERROR_NOT_READY"
    with pytest.raises(GpuFailed, match="CUDA_ERROR_NOT_READY"):
        gpu.lock(PID, 250)


def test_illegal_state_once_then_the_retry_succeeds() -> None:
    gpu = gpu_in(CudaState.RUNNING)
    gpu.fail_illegal_state_once.add(PID)
    with pytest.raises(GpuFailed) as info:
        gpu.lock(PID, 100)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert gpu.state(PID) is CudaState.RUNNING
    gpu.lock(PID, 100)
    assert gpu.state(PID) is CudaState.LOCKED
    assert not gpu.fail_illegal_state_once


@pytest.mark.parametrize(
    ("attr", "state", "method"),
    [
        ("fail_checkpoint", CudaState.LOCKED, "checkpoint"),
        ("fail_restore", CudaState.CHECKPOINTED, "restore"),
        ("fail_unlock", CudaState.LOCKED, "unlock"),
    ],
)
def test_injected_failures_keep_the_state(attr: str, state: CudaState, method: str) -> None:
    gpu = gpu_in(state)
    getattr(gpu, attr).add(PID)
    for _ in range(2):  # until the test clears the set
        with pytest.raises(GpuFailed) as info:
            call(gpu, method)
        assert info.value.code == gpu.fail_code
        assert gpu.state(PID) is state
    getattr(gpu, attr).clear()
    call(gpu, method)
    assert gpu.state(PID) is LEGAL[(state, method)]


def test_not_a_cuda_process() -> None:
    gpu = FakeGpu()
    assert not gpu.uses_cuda(PID)
    for method in (*METHODS, "state"):
        with pytest.raises(GpuFailed) as info:
            call(gpu, method)
        assert info.value.code == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.parametrize(
    "message",
    ["driver CUDA 12.4 lacks the checkpoint API: needs r570 / CUDA 12.8",
     "the NVIDIA driver cannot do cuCheckpointProcessLock: Function not found"],
)
def test_unavailable(message: str) -> None:
    gpu = gpu_in(CudaState.RUNNING)
    gpu.add_cuda_process(PID + 1, state=CudaState.CHECKPOINTED)
    gpu.unavailable = message
    inv = gpu.inventory()
    assert not inv.available and inv.message == message
    for method in (*METHODS, "state"):
        with pytest.raises(GpuUnavailable) as info:
            call(gpu, method)
        assert info.value.message == message
    with pytest.raises(GpuUnavailable, match="uses an NVIDIA GPU"):
        gpu.uses_cuda(PID)
    assert not gpu.uses_cuda(PID + 1), "checkpointed: holds no GPU"
    assert not gpu.uses_cuda(PID + 2), "not a CUDA process"


def test_restore_needs_the_memory_back() -> None:
    gpu = FakeGpu()
    gpu.add_cuda_process(PID, 60 * GIB, state=CudaState.CHECKPOINTED)
    gpu.add_cuda_process(PID + 1, 30 * GIB)  # took the memory meanwhile
    with pytest.raises(GpuFailed) as info:
        gpu.restore(PID)
    assert info.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
    assert gpu.state(PID) is CudaState.CHECKPOINTED
    gpu.remove_cuda_process(PID + 1)
    gpu.restore(PID)
    assert gpu.state(PID) is CudaState.LOCKED


def test_restore_onto_another_gpu() -> None:
    gpu = FakeGpu([H100, SECOND])
    gpu.add_cuda_process(PID, 4 * GIB, state=CudaState.CHECKPOINTED)
    swap = {H100.uuid: SECOND.uuid, SECOND.uuid: H100.uuid}
    gpu.restore(PID, swap)
    gpu.unlock(PID)
    assert gpu.inventory().uses == (GpuUse(PID, SECOND.uuid, 4 * GIB),)
    assert gpu.restore_maps[PID] == swap


def test_a_map_must_pair_every_gpu_of_the_node_not_only_those_used() -> None:
    """The driver's rule (issue #15): a pair for every checkpointed GPU, identity pairs
    included — a job on GPU 0 of a node of two needs two pairs."""
    gpu = FakeGpu([H100, SECOND])
    gpu.add_cuda_process(PID, 4 * GIB, state=CudaState.CHECKPOINTED)
    with pytest.raises(GpuFailed) as info:
        gpu.restore(PID, {H100.uuid: SECOND.uuid})
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    assert f"the GPU map lacks {SECOND.uuid}" in info.value.message
    assert gpu.state(PID) is CudaState.CHECKPOINTED


def test_a_restore_needs_the_same_gpu_count() -> None:
    gpu = FakeGpu([H100, SECOND])
    gpu.add_cuda_process(PID, state=CudaState.CHECKPOINTED)
    gpu.gpus = [H100]
    with pytest.raises(GpuFailed, match="checkpointed on 2 GPUs, this node has 1"):
        gpu.restore(PID)
    gpu.gpus = [H100, SECOND]
    gpu.restore(PID)
    assert gpu.state(PID) is CudaState.LOCKED


def test_identity_map_needs_no_r580() -> None:
    gpu = FakeGpu(cuda_version=12080)
    gpu.add_cuda_process(PID, state=CudaState.CHECKPOINTED)
    gpu.restore(PID, {H100.uuid: H100.uuid})
    assert gpu.state(PID) is CudaState.LOCKED


def test_remap_on_an_old_driver() -> None:
    gpu = FakeGpu([H100, SECOND], cuda_version=12080)
    gpu.add_cuda_process(PID, state=CudaState.CHECKPOINTED)
    with pytest.raises(GpuUnavailable) as info:
        gpu.restore(PID, {H100.uuid: SECOND.uuid})
    assert "needs an r580 / CUDA 13.0 driver; this driver is CUDA 12.8" in info.value.message
    assert gpu.state(PID) is CudaState.CHECKPOINTED


@pytest.mark.parametrize(
    ("pairs", "words"),
    [
        ({SECOND.uuid: H100.uuid}, "the GPU map lacks"),
        ({H100.uuid: "GPU-00000000-0000-0000-0000-000000000000", SECOND.uuid: SECOND.uuid,
          A100.uuid: A100.uuid}, "no GPU"),
        ({H100.uuid: A100.uuid, SECOND.uuid: SECOND.uuid, A100.uuid: H100.uuid}, "not a NVIDIA"),
        ({H100.uuid: SECOND.uuid, SECOND.uuid: SECOND.uuid, A100.uuid: A100.uuid}, "two GPUs"),
    ],
)
def test_bad_maps(pairs: dict[str, str], words: str) -> None:
    gpu = FakeGpu([H100, SECOND, A100])
    gpu.add_cuda_process(PID, state=CudaState.CHECKPOINTED)
    with pytest.raises(GpuFailed) as info:
        gpu.restore(PID, pairs)
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    assert words in info.value.message
    assert gpu.state(PID) is CudaState.CHECKPOINTED
    assert gpu.restore_maps[PID] == pairs


def test_with_a_process_table_the_state_outlives_the_process() -> None:
    table = FakeProcessTable()
    table.add_process(PID, comm="fill")
    gpu = FakeGpu(processes=table)
    gpu.add_cuda_process(PID)
    gpu.lock(PID, 0)
    gpu.checkpoint(PID)
    table.terminate(PID)  # CRIU dumped and killed it
    assert not gpu.uses_cuda(PID)
    with pytest.raises(GpuFailed) as info:
        gpu.restore(PID)
    assert info.value.code == "NO_SUCH_PROCESS"
    table.add_process(PID, comm="fill")  # CRIU restored it
    assert gpu.state(PID) is CudaState.CHECKPOINTED
    gpu.restore(PID)
    gpu.unlock(PID)
    assert gpu.inventory().uses == (GpuUse(PID, H100.uuid, 2**30),)


def test_add_cuda_process_on_an_unknown_gpu() -> None:
    with pytest.raises(ValueError, match="no such GPU"):
        FakeGpu().add_cuda_process(PID, gpus=["GPU-nope"])


def test_no_gpus() -> None:
    inv = FakeGpu([]).inventory()
    assert not inv.available and "sees no GPU" in inv.message
