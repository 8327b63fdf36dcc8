"""``CudaDriverCheckpointer`` at its edges (issue #15): types the bindings lack, foreign
exceptions, stuck driver calls, bindings that hold the GIL, probe errors, bad timeouts."""

from __future__ import annotations

import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.cuda import CudaDriverCheckpointer, worker
from ckptd.adapters.cuda.support import SUPPORTED_BINDINGS
from ckptd.domain import CudaState
from ckptd.errors import CkptdError, GpuFailed, GpuUnavailable

from .stubs import CUresult, StubCu, fake_proc

PID = 4100
PEER = 4300  # another CUDA process
CPU_ONLY = 4400  # maps no /dev/nvidia*
OLD = "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45"
NEW = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    proc = fake_proc(tmp_path / "proc", [PID, PEER, CPU_ONLY], nvidia=(PID, PEER))
    made: list[CudaDriverCheckpointer] = []

    def build(cu: Any, version: str = "13.4.4", **kwargs: Any) -> CudaDriverCheckpointer:
        kwargs.setdefault("cuda_checkpoint", None)
        adapter = CudaDriverCheckpointer(
            driver=cu, driver_bindings_version=version, proc=proc, **kwargs
        )
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


# ---- (2) a type the bindings lack; foreign exceptions ----------------------------------------


def test_bindings_without_restore_args_refuse_a_remap_clearly(make: Any) -> None:
    """cuda-bindings 13.3.0: the functions and CUcheckpointGpuPair, no
    CUcheckpointRestoreArgs. The version alone says "can remap"; the struct says no."""
    cu = StubCu(states={PID: 2}, missing=("CUcheckpointRestoreArgs",))
    gpu = make(cu, version="13.3.0")
    refusal = gpu.remap_refusal()
    assert refusal is not None and "lacks CUcheckpointRestoreArgs" in refusal
    with pytest.raises(GpuUnavailable) as info:
        gpu.restore(PID, {OLD: NEW})
    assert "CUcheckpointRestoreArgs" in info.value.message and info.value.pid == PID
    assert cu.states[PID] == 2, "nothing restored"
    gpu.restore(PID)  # onto the same GPUs it still restores
    assert cu.states[PID] == 1


def test_a_remap_capable_backend_says_so(make: Any) -> None:
    assert make(StubCu(states={PID: 2})).remap_refusal() is None


@pytest.mark.parametrize(
    ("raised", "kind", "code"),
    [(KeyError("weird"), GpuFailed, "INTERNAL"), (TypeError("bad arg"), GpuUnavailable, "")],
)
def test_foreign_exceptions_become_ckptd_errors_with_their_cause(
    make: Any, raised: Exception, kind: type[CkptdError], code: str
) -> None:
    cu = StubCu(states={PID: 0})
    cu.raise_on["cuCheckpointProcessGetState"] = raised
    with pytest.raises(kind) as info:
        make(cu).state(PID)
    assert info.value.__cause__ is raised
    assert info.value.pid == PID
    assert getattr(info.value, "code", "") == code


# ---- (4) stuck driver calls --------------------------------------------------------------


class StuckCu(StubCu):
    """``cuCheckpointProcessCheckpoint`` of ``PID`` blocks until ``release`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.entered = threading.Event()

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[CUresult]:
        if pid == PID:
            self.entered.set()
            self.release.wait(30)
        return super().cuCheckpointProcessCheckpoint(pid, args)


def test_a_stuck_call_is_bounded_and_the_daemon_keeps_serving(make: Any) -> None:
    cu = StuckCu(states={PID: 1, PEER: 0})
    gpu = make(cu, call_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(GpuFailed) as info:
        gpu.checkpoint(PID)
    assert time.monotonic() - started < 5
    assert (info.value.code, info.value.pid) == ("TIMEOUT", PID)
    assert "within 0.3s" in info.value.message
    # later calls are served by a new worker ...
    assert gpu.state(PEER) is CudaState.RUNNING
    gpu.lock(PEER, 1000)
    gpu.unlock(PEER)
    # ... except on the stuck pid: no second call races the first in the driver
    with pytest.raises(GpuFailed) as busy:
        gpu.state(PID)
    assert busy.value.code == "BUSY"
    # the late checkpoint finishes: its dump failed long ago, so CUDA goes back to RUNNING
    cu.release.set()
    deadline = time.monotonic() + 5
    while cu.states[PID] != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cu.states[PID] == 0
    late = [n for n, args, _ in cu.calls if args[:1] == (PID,)
            and n in ("cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")]
    assert late == ["cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
    while gpu._worker.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gpu.state(PID) is CudaState.RUNNING


def test_close_is_not_blocked_by_a_stuck_call(make: Any) -> None:
    cu = StuckCu(states={PID: 1})
    gpu = make(cu, call_timeout_s=60)
    caller = threading.Thread(target=gpu.checkpoint, args=(PID,))
    caller.start()
    assert cu.entered.wait(5)
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "CLOSE_WAIT_S", 0.2)
        gpu.close()
    assert time.monotonic() - started < 2
    with pytest.raises(GpuUnavailable, match="closed"):
        gpu.state(PID)
    cu.release.set()
    caller.join(5)


# ---- (5) bindings that hold the GIL -------------------------------------------------------


def test_bindings_older_than_12_9_1_are_not_used(make: Any, tmp_path: Path) -> None:
    cu = StubCu(version=12080, states={PID: 0})
    with pytest.raises(GpuUnavailable) as info:
        make(cu, version="12.8.0").lock(PID, 100)
    assert "holds the GIL during driver calls" in info.value.message
    assert "needs cuda-bindings >= 12.9.1" in info.value.message
    assert not [n for n in cu.names() if n.startswith("cuCheckpoint")]
    binary = tmp_path / "cuda-checkpoint"
    binary.write_text("")
    fallback = make(cu, version="12.8.0", cuda_checkpoint=str(binary),
                    run=lambda argv, timeout: (0, "--action\n"))
    assert str(binary) in fallback.describe(), "the utility (a subprocess) serves instead"


# ---- (6) probe errors, lock timeouts --------------------------------------------------------


def test_a_probe_error_is_not_read_as_no_cuda(make: Any) -> None:
    cu = StubCu(states={PID: 0})
    cu.fail["cuCheckpointProcessGetRestoreThreadId"] = CUresult.CUDA_ERROR_NOT_PERMITTED
    with pytest.raises(GpuFailed) as info:
        make(cu).uses_cuda(PID)
    assert info.value.code == "CUDA_ERROR_NOT_PERMITTED"
    assert f"cannot tell whether pid {PID} uses CUDA" in info.value.message
    cu.fail["cuCheckpointProcessGetRestoreThreadId"] = CUresult.CUDA_ERROR_NOT_FOUND
    assert make(cu).uses_cuda(PID) is False


def test_not_initialized_is_no_cuda_context_of_its_own(make: Any) -> None:
    """Seen on an H100 (driver 580.159, 2026-11-26): the probe answers
    CUDA_ERROR_NOT_INITIALIZED for every process that never initialised CUDA itself, so every
    CPU-only dump on a GPU node failed with "cannot tell whether pid N uses CUDA" — and so
    did a training job whose DataLoader workers, forked from the CUDA process, map its
    /dev/nvidia* but hold no context. Both are CPU processes to the driver; any other probe
    error stays a failure to tell."""
    cu = StubCu(states={PID: 0})
    cu.fail["cuCheckpointProcessGetRestoreThreadId"] = CUresult.CUDA_ERROR_NOT_INITIALIZED
    adapter = make(cu)
    assert adapter.uses_cuda(CPU_ONLY) is False
    assert adapter.uses_cuda(PEER) is False  # maps /dev/nvidia0, no context of its own
    cu.fail["cuCheckpointProcessGetRestoreThreadId"] = CUresult.CUDA_ERROR_NOT_PERMITTED
    with pytest.raises(GpuFailed, match=f"cannot tell whether pid {CPU_ONLY} uses CUDA"):
        adapter.uses_cuda(CPU_ONLY)


def test_a_negative_lock_timeout_is_refused_not_made_infinite(make: Any) -> None:
    cu = StubCu(states={PID: 0})
    with pytest.raises(GpuFailed) as info:
        make(cu).lock(PID, -1)
    assert info.value.code == "INVALID_TIMEOUT"
    assert "cuCheckpointProcessLock" not in cu.names()
    assert cu.states[PID] == 0


def test_the_gpu_extra_requires_bindings_that_release_the_gil() -> None:
    """pyproject's ``gpu`` extra, the adapter and the manual's GPU guide agree: >= 12.9.1,
    never 13.0.0/13.0.1."""
    root = Path(__file__).resolve().parents[3]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["gpu"]
    (bindings,) = [d for d in extra if d.startswith("cuda-bindings")]
    assert bindings == "cuda-bindings>=12.9.1,!=13.0.0,!=13.0.1"
    readme = (root / "docs/guides/gpus.md").read_text()  # the README's CUDA section, moved
    assert "Supported\n  cuda-bindings: >= 12.9.1, except 13.0.0 and 13.0.1" in readme
    assert all(v in readme for v in SUPPORTED_BINDINGS)


class StuckVersionCu(StubCu):
    """``cuDriverGetVersion`` (the backend's choice) blocks until ``release`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()

    def cuDriverGetVersion(self) -> Any:
        self.release.wait(30)
        return super().cuDriverGetVersion()


def test_pid_less_calls_that_time_out_answer_a_reason_not_raise(make: Any) -> None:
    """Issue 23 (8): remap_refusal never raises (the port), describe neither."""
    cu = StuckVersionCu(states={PID: 0})
    gpu = make(cu, query_timeout_s=0.2)
    try:
        refusal = gpu.remap_refusal()
        assert refusal is not None and "TIMEOUT" not in refusal.split(":")[0]
        assert "could not say whether it can restore onto other GPUs" in refusal
        assert gpu.describe().startswith("unavailable: ")
    finally:
        cu.release.set()


# ---- issue 23 (8): the bindings major against the driver --------------------------------------


@pytest.mark.parametrize("driver", [12080, 12090])
def test_bindings_13_on_an_r570_or_r575_driver_say_the_pip_command(
    make: Any, driver: int
) -> None:
    cu = StubCu(version=driver, states={PID: 0})
    with pytest.raises(GpuUnavailable) as info:
        make(cu, version="13.0.3").lock(PID, 100)
    message = info.value.message
    assert "cuda-bindings 13.0.3 needs an NVIDIA driver r580 (580.65.06) or newer" in message
    assert message.endswith("pip install 'cuda-bindings>=12.9.1,<13'")
    assert "\n" not in message
    assert info.value.hint == "pip install 'cuda-bindings>=12.9.1,<13'"
    assert not [n for n in cu.names() if n.startswith("cuCheckpoint")]


def test_bindings_12_on_r570_and_13_on_r580_serve(make: Any) -> None:
    make(StubCu(version=12080, states={PID: 0}), version="12.9.4").lock(PID, 100)
    make(StubCu(version=13000, states={PID: 0}), version="13.0.3").lock(PID, 100)
