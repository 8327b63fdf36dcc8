"""Contract of the GPU ports (``GpuInventoryPort``, ``GpuCheckpointer``): ``FakeGpu`` always,
NVML + the CUDA driver where NVML sees a GPU (skipped with the reason elsewhere). The CUDA
cycle on real hardware needs ``native/gpu/bin/fill`` (built with nvcc on first use)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from ckptd.adapters.cuda.support import uuid_to_bytes
from ckptd.adapters.nvml import NvmlInventory
from ckptd.domain import CudaState, GpuInventory
from ckptd.errors import GpuFailed, GpuUnavailable

from .harness import GpuHarness, exec_done

LOCK_TIMEOUT_MS = 10_000


def cuda_pid(gpu: GpuHarness) -> int:
    pid = gpu.spawn_cuda()
    if pid is None:
        pytest.skip(gpu.no_cuda_reason)
    return pid


def check_inventory(inv: GpuInventory) -> None:
    assert isinstance(inv.available, bool)
    assert isinstance(inv.message, str) and inv.message
    if not inv.available:
        return
    assert inv.gpus, "available means at least one GPU"
    assert inv.driver_version
    assert inv.cuda_version >= 10000, "cuDriverGetVersion form: 1000*major + 10*minor"
    assert [g.index for g in inv.gpus] == list(range(len(inv.gpus)))
    for g in inv.gpus:
        assert g.uuid.startswith("GPU-")
        assert len(uuid_to_bytes(g.uuid)) == 16
        assert g.name
        assert g.memory_total > 0
        assert 0 <= g.memory_free <= g.memory_total
        assert g.compute_capability == "" or re.fullmatch(r"\d+\.\d+", g.compute_capability)
    known = inv.by_uuid()
    assert len(known) == len(inv.gpus), "UUIDs are unique"
    for use in inv.uses:
        assert use.uuid in known
        assert use.pid > 0 and use.memory >= 0


def test_inventory_never_raises_and_is_well_formed(gpu: GpuHarness) -> None:
    for _ in range(2):
        check_inventory(gpu.inventory.inventory())


def test_real_nvml_inventory_never_raises_here() -> None:
    """Runs everywhere: without pynvml, driver or GPU the answer is ``available=False``."""
    inv = NvmlInventory().inventory()
    check_inventory(inv)
    if not inv.available:
        assert inv.gpus == () and inv.uses == ()


def test_visible_to_names_gpus_of_the_inventory(gpu: GpuHarness) -> None:
    seen = gpu.inventory.visible_to(gpu.spawn_plain())
    if seen is not None:
        order = [g.uuid for g in gpu.inventory.inventory().gpus]
        assert list(seen) == [u for u in order if u in seen], "each once, in inventory order"


def test_a_process_that_may_use_no_gpu_sees_none(gpu: GpuHarness) -> None:
    assert gpu.inventory.visible_to(gpu.spawn_blind()) == ()


def test_real_visible_to_runs_here() -> None:
    """Runs everywhere: a child in this process's root with no ``*_VISIBLE_DEVICES`` is
    restricted by nothing (NVML not needed); one with ``CUDA_VISIBLE_DEVICES`` empty sees no
    GPU; a process that is gone cannot be inspected."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VISIBLE_DEVICES")}
    inventory = NvmlInventory()
    for extra, want in (({}, None), ({"CUDA_VISIBLE_DEVICES": ""}, ())):
        child = subprocess.Popen(["sleep", "60"], env={**env, **extra})
        try:
            assert inventory.visible_to(exec_done(child.pid)) == want
        finally:
            child.kill()
            child.wait()
    with pytest.raises(GpuUnavailable, match=f"pid {child.pid}"):
        inventory.visible_to(child.pid)


def test_a_process_without_cuda(gpu: GpuHarness) -> None:
    pid = gpu.spawn_plain()
    assert gpu.checkpointer.uses_cuda(pid) is False
    with pytest.raises(GpuFailed) as info:
        gpu.checkpointer.lock(pid, 1000)
    assert info.value.pid == pid
    assert info.value.code


def test_a_process_that_is_gone_does_not_use_cuda(gpu: GpuHarness) -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    assert gpu.checkpointer.uses_cuda(done.pid) is False


def test_full_cycle(gpu: GpuHarness) -> None:
    pid = cuda_pid(gpu)
    cp = gpu.checkpointer
    assert cp.uses_cuda(pid) is True
    assert cp.state(pid) is CudaState.RUNNING
    assert pid in {u.pid for u in gpu.inventory.inventory().uses}

    cp.lock(pid, LOCK_TIMEOUT_MS)
    assert cp.state(pid) is CudaState.LOCKED
    assert not gpu.progresses(pid, timeout=1.0), "a locked process makes no CUDA progress"

    cp.checkpoint(pid)
    assert cp.state(pid) is CudaState.CHECKPOINTED
    assert pid not in {u.pid for u in gpu.inventory.inventory().uses}, (
        "a checkpointed process holds no device memory"
    )

    cp.restore(pid)
    assert cp.state(pid) is CudaState.LOCKED

    cp.unlock(pid)
    assert cp.state(pid) is CudaState.RUNNING
    assert gpu.progresses(pid), "the process computes again after unlock"
    assert pid in {u.pid for u in gpu.inventory.inventory().uses}


def test_refused_transitions_change_nothing(gpu: GpuHarness) -> None:
    pid = cuda_pid(gpu)
    cp = gpu.checkpointer
    with pytest.raises(GpuFailed) as info:
        cp.checkpoint(pid)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert info.value.pid == pid
    for refused in (cp.restore, cp.unlock):
        with pytest.raises(GpuFailed):
            refused(pid)
    assert cp.state(pid) is CudaState.RUNNING

    cp.lock(pid, LOCK_TIMEOUT_MS)
    with pytest.raises(GpuFailed):
        cp.lock(pid, LOCK_TIMEOUT_MS)
    with pytest.raises(GpuFailed):
        cp.restore(pid)
    assert cp.state(pid) is CudaState.LOCKED
    cp.unlock(pid)
    assert cp.state(pid) is CudaState.RUNNING
    assert gpu.progresses(pid)


def test_restore_onto_the_same_gpus_by_map(gpu: GpuHarness) -> None:
    pid = cuda_pid(gpu)
    cp = gpu.checkpointer
    used = {u.uuid for u in gpu.inventory.inventory().uses if u.pid == pid}
    assert used, "the CUDA process holds memory on some GPU"
    cp.lock(pid, LOCK_TIMEOUT_MS)
    cp.checkpoint(pid)
    cp.restore(pid, {uuid: uuid for uuid in used})
    cp.unlock(pid)
    assert cp.state(pid) is CudaState.RUNNING
    assert gpu.progresses(pid)


def test_remap_refusal_never_raises(gpu: GpuHarness) -> None:
    """Asked at restore planning: a reason or None, whatever the driver and bindings."""
    for _ in range(2):
        answer = gpu.checkpointer.remap_refusal()
        assert answer is None or (isinstance(answer, str) and answer)


def test_a_negative_lock_timeout_is_refused(gpu: GpuHarness) -> None:
    pid = cuda_pid(gpu)
    with pytest.raises(GpuFailed) as info:
        gpu.checkpointer.lock(pid, -1)
    assert info.value.code == "INVALID_TIMEOUT" and info.value.pid == pid
    assert gpu.checkpointer.state(pid) is CudaState.RUNNING


def test_a_lock_timeout_is_not_ready_and_leaves_the_process_running(gpu: GpuHarness) -> None:
    """The documented lock-timeout code (FakeGpu's injected one; real hardware: skipped)."""
    fake = getattr(gpu.checkpointer, "fail_lock_timeout", None)
    if fake is None:
        pytest.skip("needs a way to make the driver's lock time out")
    pid = cuda_pid(gpu)
    fake.add(pid)
    with pytest.raises(GpuFailed) as info:
        gpu.checkpointer.lock(pid, 1)
    assert info.value.code == "CUDA_ERROR_NOT_READY"
    assert gpu.checkpointer.state(pid) is CudaState.RUNNING
    fake.discard(pid)
