"""``CudaDriverCheckpointer`` over a stubbed ``cuda.bindings.driver``: the calls it makes,
error mapping, version checks, the Tgid check, the worker thread."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.cuda import CudaDriverCheckpointer
from ckptd.adapters.cuda.support import NOT_INSTALLED
from ckptd.domain import CudaState
from ckptd.errors import GpuFailed, GpuUnavailable

from .stubs import CUresult, StubCu, fake_proc

PID = 4100
OTHER = 4200  # a process without CUDA
THREAD = 4101  # a thread of PID
NVIDIA = 4300  # maps /dev/nvidia0 (a CUDA process, as far as /proc can tell)
OLD = "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45"
NEW = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return fake_proc(tmp_path / "proc", [PID, OTHER, NVIDIA], threads={THREAD: PID},
                     nvidia=(PID, NVIDIA))


@pytest.fixture
def cu() -> StubCu:
    return StubCu(version=13000, states={PID: 0})


Made = tuple[CudaDriverCheckpointer, StubCu]


@pytest.fixture
def make(proc: Path) -> Iterator[Any]:
    made: list[CudaDriverCheckpointer] = []

    def build(
        cu: Any, version: str = "13.4.4", binary: str | None = None, run: Any = None
    ) -> CudaDriverCheckpointer:
        kwargs: dict[str, Any] = {"run": run} if run is not None else {}
        adapter = CudaDriverCheckpointer(
            driver=cu, driver_bindings_version=version, cuda_checkpoint=binary, proc=proc,
            **kwargs,
        )
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


def test_full_cycle_and_states(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    assert gpu.uses_cuda(PID)
    assert gpu.state(PID) is CudaState.RUNNING
    gpu.lock(PID, 10_000)
    assert gpu.state(PID) is CudaState.LOCKED
    gpu.checkpoint(PID)
    assert gpu.state(PID) is CudaState.CHECKPOINTED
    gpu.restore(PID)
    assert gpu.state(PID) is CudaState.LOCKED
    gpu.unlock(PID)
    assert gpu.state(PID) is CudaState.RUNNING
    calls = {name: args for name, args, _ in cu.calls}
    assert calls["cuCheckpointProcessLock"][1].timeoutMs == 10_000
    assert calls["cuCheckpointProcessCheckpoint"] == (PID, None)
    assert calls["cuCheckpointProcessRestore"] == (PID, None)
    assert calls["cuCheckpointProcessUnlock"] == (PID, None)
    assert gpu.describe() == "cuda-bindings 13.4.4, driver CUDA 13.0"


def test_cuinit_once_before_any_checkpoint_call(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    gpu.uses_cuda(PID)
    gpu.lock(PID, 0)
    gpu.unlock(PID)
    names = cu.names()
    assert names.count("cuInit") == 1
    first_checkpoint_call = min(i for i, n in enumerate(names) if n.startswith("cuCheckpoint"))
    assert names.index("cuDriverGetVersion") < names.index("cuInit") < first_checkpoint_call
    assert [args for name, args, _ in cu.calls if name == "cuInit"] == [(0,)]


def test_every_driver_call_runs_on_one_worker_thread(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    gpu.uses_cuda(PID)
    gpu.lock(PID, 0)
    gpu.state(PID)
    gpu.unlock(PID)
    threads = {thread for _, _, thread in cu.calls}
    assert len(threads) == 1
    (name,) = threads
    assert name.startswith("ckptd-cuda")
    assert name != threading.current_thread().name


class SlowCu(StubCu):
    """Each state query takes a while and notes how many ran at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.running = 0
        self.most = 0
        self.guard = threading.Lock()

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[CUresult, Any]:
        with self.guard:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.01)
        try:
            return super().cuCheckpointProcessGetState(pid)
        finally:
            with self.guard:
                self.running -= 1


def test_calls_from_many_threads_are_serialized(make: Any) -> None:
    cu = SlowCu(states={PID: 0})
    gpu = make(cu)
    results: list[CudaState] = []
    callers = [threading.Thread(target=lambda: results.append(gpu.state(PID))) for _ in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(10)
    assert results == [CudaState.RUNNING] * 8
    assert cu.most == 1


def test_driver_errors_become_gpu_failed_with_the_error_name(make: Any, cu: StubCu) -> None:
    cu.fail["cuCheckpointProcessLock"] = CUresult.CUDA_ERROR_TIMEOUT
    gpu = make(cu)
    with pytest.raises(GpuFailed) as info:
        gpu.lock(PID, 500)
    err = info.value
    assert err.message == f"cuCheckpointProcessLock for pid {PID} failed: CUDA_ERROR_TIMEOUT"
    assert (err.call, err.code, err.pid) == ("cuCheckpointProcessLock", "CUDA_ERROR_TIMEOUT", PID)
    assert gpu.state(PID) is CudaState.RUNNING


def test_illegal_transition_is_the_drivers_illegal_state(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    with pytest.raises(GpuFailed) as info:
        gpu.checkpoint(PID)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert info.value.call == "cuCheckpointProcessCheckpoint"


def test_error_name_falls_back_to_the_enum_name(make: Any, cu: StubCu) -> None:
    cu.error_name_works = False
    cu.fail["cuCheckpointProcessUnlock"] = CUresult.CUDA_ERROR_NOT_PERMITTED
    cu.states[PID] = 1
    with pytest.raises(GpuFailed, match="CUDA_ERROR_NOT_PERMITTED"):
        make(cu).unlock(PID)


def test_a_process_without_cuda(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    assert not gpu.uses_cuda(OTHER)
    with pytest.raises(GpuFailed) as info:
        gpu.lock(OTHER, 1000)
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"


def test_a_thread_id_is_refused_before_any_driver_call(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    for call in (gpu.uses_cuda, gpu.state, gpu.checkpoint, gpu.unlock, gpu.restore):
        with pytest.raises(GpuFailed) as info:
            call(THREAD)
        assert info.value.code == "NOT_A_PROCESS"
        assert f"{THREAD} is a thread of process {PID}" in info.value.message
        assert info.value.hint == f"pass the process id {PID}"
    with pytest.raises(GpuFailed, match="thread"):
        gpu.lock(THREAD, 10)
    assert not [name for name in cu.names() if name.startswith("cuCheckpoint")]


def test_a_pid_that_does_not_exist(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    assert not gpu.uses_cuda(99999)
    with pytest.raises(GpuFailed) as info:
        gpu.lock(99999, 10)
    assert info.value.code == "NO_SUCH_PROCESS"


def test_unexpected_process_state(make: Any, cu: StubCu) -> None:
    cu.states[PID] = 4  # CHECKPOINTING (custom storage)
    with pytest.raises(GpuFailed, match="unexpected state CU_PROCESS_STATE_CHECKPOINTING"):
        make(cu).state(PID)


# ---- versions and availability ---------------------------------------------------------------


def test_too_old_driver(make: Any) -> None:
    cu = StubCu(version=12040, states={PID: 0})
    gpu = make(cu)
    with pytest.raises(GpuUnavailable) as info:
        gpu.lock(PID, 10)
    assert "driver CUDA 12.4 lacks the checkpoint API: needs r570 / CUDA 12.8" in str(info.value)
    assert info.value.hint == "upgrade the NVIDIA driver to r570 or newer"
    assert info.value.pid == PID
    assert "cuInit" not in cu.names()


def test_no_driver_support_and_process_without_gpu_is_not_cuda(make: Any) -> None:
    gpu = make(StubCu(version=12040, states={PID: 0}))
    assert not gpu.uses_cuda(OTHER)


def test_no_driver_support_and_process_with_gpu_raises(make: Any) -> None:
    gpu = make(StubCu(version=12040, states={PID: 0}))
    with pytest.raises(GpuUnavailable) as info:
        gpu.uses_cuda(NVIDIA)
    assert f"pid {NVIDIA} uses an NVIDIA GPU but cannot be checkpointed" in info.value.message
    assert "12.4" in info.value.message
    assert info.value.pid == NVIDIA


def test_the_reason_is_found_once(make: Any) -> None:
    cu = StubCu(version=12040)
    gpu = make(cu)
    for _ in range(3):
        with pytest.raises(GpuUnavailable):
            gpu.state(PID)
    assert cu.names().count("cuDriverGetVersion") == 1


@pytest.mark.parametrize(
    ("version", "missing", "need"),
    [
        ("13.0.1", ("cuCheckpointProcessRestore",), "13.0.2"),
        ("12.6.0", tuple(
            f"cuCheckpointProcess{n}"
            for n in ("GetRestoreThreadId", "GetState", "Lock", "Checkpoint", "Restore", "Unlock")
        ), "12.9.1"),
    ],
)
def test_bindings_without_the_functions(
    make: Any, version: str, missing: tuple[str, ...], need: str
) -> None:
    gpu = make(StubCu(states={PID: 0}, missing=missing), version=version)
    with pytest.raises(GpuUnavailable) as info:
        gpu.lock(PID, 10)
    assert f"cuda-bindings {version} lacks {missing[0]}" in info.value.message
    assert f"needs cuda-bindings >= {need}" in info.value.message


def test_cuinit_failure(make: Any) -> None:
    cu = StubCu(states={PID: 0}, init_result=CUresult.CUDA_ERROR_NO_DEVICE)
    with pytest.raises(GpuUnavailable, match="cuInit failed: CUDA_ERROR_NO_DEVICE"):
        make(cu).lock(PID, 10)


def test_no_libcuda(make: Any, tmp_path: Path) -> None:
    cu = StubCu(states={PID: 0})
    cu.raise_on["cuDriverGetVersion"] = RuntimeError("Failed to dlopen libcuda.so.1")
    binary = tmp_path / "cuda-checkpoint"
    binary.write_text("#!/bin/sh\nexit 1\n")
    gpu = make(cu, binary=str(binary))
    with pytest.raises(GpuUnavailable, match=r"no usable NVIDIA driver \(libcuda.so.1\)"):
        gpu.lock(PID, 10)  # and the utility is no way around a missing driver
    assert not gpu.uses_cuda(OTHER)


def test_function_missing_in_the_driver_at_call_time(make: Any, cu: StubCu) -> None:
    cu.raise_on["cuCheckpointProcessLock"] = RuntimeError(
        'Function "cuCheckpointProcessLock" not found'
    )
    with pytest.raises(GpuUnavailable, match="cannot do cuCheckpointProcessLock"):
        make(cu).lock(PID, 10)


def test_bindings_not_installed(
    monkeypatch: pytest.MonkeyPatch, proc: Path
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # import raises
    gpu = CudaDriverCheckpointer(cuda_checkpoint=None, proc=proc)
    try:
        with pytest.raises(GpuUnavailable) as info:
            gpu.lock(PID, 10)
        assert info.value.message == NOT_INSTALLED
        assert not gpu.uses_cuda(OTHER)
        assert gpu.describe() == f"unavailable: {NOT_INSTALLED}"
    finally:
        gpu.close()


def test_closed_adapter_refuses_calls(make: Any, cu: StubCu) -> None:
    gpu = make(cu)
    gpu.close()
    gpu.close()
    with pytest.raises(GpuUnavailable, match="closed"):
        gpu.state(PID)


# ---- GPU pairs -------------------------------------------------------------------------------


def restore_args(cu: StubCu) -> Any:
    (args,) = [a[1] for name, a, _ in cu.calls if name == "cuCheckpointProcessRestore"]
    return args


def test_restore_onto_other_gpus_fills_the_pairs(make: Any) -> None:
    cu = StubCu(states={PID: 2})
    second_old = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    second_new = "GPU-ffffffff-0000-1111-2222-333333333333"
    make(cu).restore(PID, {second_old: second_new, OLD: NEW})
    args = restore_args(cu)
    assert args.gpuPairsCount == 2
    pairs = [(p.oldUuid.bytes, p.newUuid.bytes) for p in args.gpuPairs]
    assert pairs == [
        (bytes.fromhex(OLD[4:].replace("-", "")), bytes.fromhex(NEW[4:].replace("-", ""))),
        (
            bytes.fromhex(second_old[4:].replace("-", "")),
            bytes.fromhex(second_new[4:].replace("-", "")),
        ),
    ]
    assert cu.states[PID] == 1


def test_identity_map_is_no_remap(make: Any) -> None:
    cu = StubCu(version=12080, states={PID: 2})
    make(cu, version="12.9.4").restore(PID, {OLD: OLD})
    assert restore_args(cu) is None


def test_remap_needs_an_r580_driver(make: Any) -> None:
    # 12.x bindings: 13.x are refused outright on r570 (issue 23, 8;
    # test_bindings_13_on_an_r570_or_r575_driver_say_the_pip_command)
    cu = StubCu(version=12080, states={PID: 2})
    with pytest.raises(GpuUnavailable) as info:
        make(cu, version="12.9.4").restore(PID, {OLD: NEW})
    assert "needs an r580 / CUDA 13.0 driver; this driver is CUDA 12.8" in info.value.message
    assert cu.states[PID] == 2


@pytest.mark.parametrize("version", ["12.9.1", "13.0.1"])
def test_remap_needs_bindings_13_0_2(make: Any, version: str) -> None:
    cu = StubCu(version=13000, states={PID: 2})
    with pytest.raises(GpuUnavailable) as info:
        make(cu, version=version).restore(PID, {OLD: NEW})
    assert "needs cuda-bindings >= 13.0.2 with CUcheckpointRestoreArgs" in info.value.message
    assert f"installed: {version}" in info.value.message


def test_remap_with_a_bad_uuid(make: Any) -> None:
    cu = StubCu(states={PID: 2})
    with pytest.raises(GpuFailed) as info:
        make(cu).restore(PID, {OLD: "GPU-nonsense"})
    assert info.value.code == "INVALID_UUID"
    assert "cuCheckpointProcessRestore" not in cu.names()


# ---- the cuda-checkpoint fallback ---------------------------------------------------------


class FakeUtility:
    """Runs like cuda-checkpoint with --action, over ``states``."""

    def __init__(self, states: dict[int, str]) -> None:
        self.states = states
        self.argvs: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        args = list(argv[1:])
        self.argvs.append(args)
        if args == ["-h"]:
            return 0, "usage: cuda-checkpoint --action <lock|checkpoint|restore|unlock>\n"
        pid = int(args[args.index("--pid") + 1])
        if args[0] == "--get-state":
            return 0, self.states[pid] + "\n"
        if args[0] == "--action":
            moves = {"lock": ("running", "locked"), "unlock": ("locked", "running")}
            before, after = moves[args[1]]
            if self.states[pid] != before:
                return 1, "Could not do it: CUDA_ERROR_ILLEGAL_STATE\n"
            self.states[pid] = after
            return 0, ""
        return 1, "unknown\n"


def test_falls_back_to_the_utility_when_the_bindings_lack_the_api(
    make: Any, tmp_path: Path
) -> None:
    binary = tmp_path / "cuda-checkpoint"
    binary.write_text("")
    utility = FakeUtility({PID: "running"})
    gpu = make(StubCu(version=12040), binary=str(binary), run=utility)
    gpu.lock(PID, 2000)
    assert gpu.state(PID) is CudaState.LOCKED
    assert ["--action", "lock", "--pid", str(PID), "--timeout", "2000"] in utility.argvs
    with pytest.raises(GpuFailed) as info:
        gpu.lock(PID, 0)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    gpu.unlock(PID)
    assert gpu.state(PID) is CudaState.RUNNING
    assert "--action" in gpu.describe()
