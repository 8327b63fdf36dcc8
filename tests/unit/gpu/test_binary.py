"""The ``cuda-checkpoint`` fallback backend over a scripted runner."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from ckptd.adapters.cuda.binary import CudaCheckpointBinary
from ckptd.domain import CudaState
from ckptd.errors import GpuFailed, GpuUnavailable

PID = 700


class Utility:
    """cuda-checkpoint as a state machine: ``actions`` False is the toggle-only kind."""

    def __init__(self, *, actions: bool, state: str = "running") -> None:
        self.actions = actions
        self.state = state
        self.argvs: list[list[str]] = []
        self.timeouts: list[float | None] = []
        self.fail_next: tuple[int, str] | None = None

    def __call__(self, argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        assert argv[0] == "/opt/cuda-checkpoint"
        args = list(argv[1:])
        self.argvs.append(args)
        self.timeouts.append(timeout)
        if args == ["-h"]:
            flags = "--toggle --get-state --get-restore-tid --pid"
            extra = " --action --timeout" if self.actions else ""
            return 0, f"Usage: cuda-checkpoint {flags}{extra}"
        if self.fail_next is not None:
            result, self.fail_next = self.fail_next, None
            return result
        if args[0] == "--get-state":
            return 0, f"{self.state}\n"
        if args[0] == "--get-restore-tid":
            return (0, f"{PID + 3}\n") if self.state != "none" else (1, "not a CUDA process\n")
        if args[0] == "--toggle":
            flip = {"running": "checkpointed", "checkpointed": "running"}
            self.state = flip[self.state]
            return 0, ""
        assert self.actions and args[0] == "--action"
        moves = {
            "lock": ("running", "locked"),
            "checkpoint": ("locked", "checkpointed"),
            "restore": ("checkpointed", "locked"),
            "unlock": ("locked", "running"),
        }
        before, after = moves[args[1]]
        if self.state != before:
            return 1, "Failed: CUDA_ERROR_ILLEGAL_STATE\n"
        self.state = after
        return 0, ""


def test_restore_tid_is_the_cuda_probe() -> None:
    utility = Utility(actions=True)
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", utility)
    assert backend.restore_tid(PID) == PID + 3
    utility.state = "none"
    assert backend.restore_tid(PID) is None


def test_action_mode_cycle() -> None:
    utility = Utility(actions=True)
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", utility)
    assert backend.has_actions
    backend.lock(PID, 5000)
    assert backend.state(PID) is CudaState.LOCKED
    backend.checkpoint(PID)
    assert backend.state(PID) is CudaState.CHECKPOINTED
    backend.restore(PID, None)
    backend.unlock(PID)
    assert backend.state(PID) is CudaState.RUNNING
    assert ["--action", "lock", "--pid", str(PID), "--timeout", "5000"] in utility.argvs
    lock_at = utility.argvs.index(["--action", "lock", "--pid", str(PID), "--timeout", "5000"])
    assert utility.timeouts[lock_at] == pytest.approx(65.0)
    checkpoint_at = utility.argvs.index(["--action", "checkpoint", "--pid", str(PID)])
    assert utility.timeouts[checkpoint_at] is None, "never kill a checkpoint half-way"


def test_failure_codes() -> None:
    utility = Utility(actions=True)
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", utility)
    with pytest.raises(GpuFailed) as info:
        backend.checkpoint(PID)
    err = info.value
    assert err.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert err.call == "cuda-checkpoint --action checkpoint"
    assert err.message.startswith(
        f"cuda-checkpoint --action checkpoint for pid {PID} failed: CUDA_ERROR_ILLEGAL_STATE"
    )
    utility.fail_next = (3, "something odd\n")
    with pytest.raises(GpuFailed) as info:
        backend.lock(PID, 0)
    assert info.value.code == "EXIT_3"
    assert "(something odd)" in info.value.message


def test_toggle_mode_keeps_locked_itself() -> None:
    utility = Utility(actions=False)
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", utility)
    assert not backend.has_actions
    backend.lock(PID, 5000)
    assert backend.state(PID) is CudaState.LOCKED
    assert utility.state == "running"
    with pytest.raises(GpuFailed, match="ILLEGAL_STATE"):
        backend.lock(PID, 0)
    backend.checkpoint(PID)
    assert utility.state == "checkpointed"
    assert backend.state(PID) is CudaState.CHECKPOINTED
    with pytest.raises(GpuFailed, match="ILLEGAL_STATE"):
        backend.unlock(PID)
    backend.restore(PID, None)
    assert utility.state == "running"
    assert backend.state(PID) is CudaState.LOCKED
    backend.unlock(PID)
    assert backend.state(PID) is CudaState.RUNNING
    assert [a[0] for a in utility.argvs].count("--toggle") == 2


def test_toggle_mode_refuses_checkpoint_of_a_running_process() -> None:
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", Utility(actions=False))
    with pytest.raises(GpuFailed) as info:
        backend.checkpoint(PID)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert "RUNNING, not LOCKED" in info.value.message


def test_no_gpu_remap() -> None:
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", Utility(actions=True))
    with pytest.raises(GpuUnavailable, match="does not restore onto other GPUs"):
        backend.restore(PID, {"GPU-a": "GPU-b"})
    assert "--device-map is not supported by ckptd" in str(backend.remap_refusal())


def test_a_probe_error_other_than_no_cuda_is_raised() -> None:
    """Issue #15 (6): --get-restore-tid failing with, e.g., NOT_PERMITTED is no "no CUDA"."""

    def run(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        return 1, "Could not get restore tid: CUDA_ERROR_NOT_PERMITTED\n"

    with pytest.raises(GpuFailed) as info:
        CudaCheckpointBinary("/opt/cuda-checkpoint", run).restore_tid(PID)
    assert info.value.code == "CUDA_ERROR_NOT_PERMITTED"
    assert f"cannot tell whether pid {PID} uses CUDA" in info.value.message

    def no_cuda(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        return 1, "CUDA_ERROR_INVALID_VALUE\n"

    assert CudaCheckpointBinary("/opt/cuda-checkpoint", no_cuda).restore_tid(PID) is None


def test_unknown_state_output() -> None:
    utility = Utility(actions=True, state="weird")
    with pytest.raises(GpuFailed, match="unknown state 'weird'"):
        CudaCheckpointBinary("/opt/cuda-checkpoint", utility).state(PID)


def test_runner_errors() -> None:
    def missing(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        raise FileNotFoundError(2, "No such file or directory")

    with pytest.raises(GpuUnavailable, match="cannot run /opt/cuda-checkpoint"):
        CudaCheckpointBinary("/opt/cuda-checkpoint", missing).state(PID)

    def hangs(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        raise subprocess.TimeoutExpired(list(argv), timeout or 0)

    with pytest.raises(GpuFailed) as info:
        CudaCheckpointBinary("/opt/cuda-checkpoint", hangs).state(PID)
    assert info.value.code == "TIMEOUT"


@pytest.mark.parametrize(
    ("printed", "code"),
    [
        ("Could not get restore thread ID for process: operation not permitted\n",
         "CUDA_ERROR_NOT_PERMITTED"),
        ("error: out of memory\n", "CUDA_ERROR_OUT_OF_MEMORY"),
        ("OS call failed or operation not supported on this OS\n",
         "CUDA_ERROR_OPERATING_SYSTEM"),
    ],
)
def test_the_utilitys_error_strings_are_read_not_taken_for_no_cuda(
    printed: str, code: str
) -> None:
    """Issue 23 (8): cuda-checkpoint prints cuGetErrorString text, not CUDA_ERROR_* names."""

    def run(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        return 1, printed

    with pytest.raises(GpuFailed) as info:
        CudaCheckpointBinary("/opt/cuda-checkpoint", run).restore_tid(PID)
    assert info.value.code == code

    def no_cuda(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        return 1, "Could not get restore thread ID for process: invalid argument\n"

    assert CudaCheckpointBinary("/opt/cuda-checkpoint", no_cuda).restore_tid(PID) is None


def test_an_illegal_state_printed_as_text_keeps_its_code_for_the_lock_retry() -> None:
    utility = Utility(actions=True)
    backend = CudaCheckpointBinary("/opt/cuda-checkpoint", utility)
    utility.fail_next = (1, "the operation cannot be performed in the present state\n")
    with pytest.raises(GpuFailed) as info:
        backend.lock(PID, 0)
    assert info.value.code == "CUDA_ERROR_ILLEGAL_STATE"
