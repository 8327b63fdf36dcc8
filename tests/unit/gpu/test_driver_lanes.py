"""Issue 23 (1): driver calls on different pids run concurrently, each call's bound counts
from its start, and a call that never started says what it was queued behind. (5): the late
answer of an abandoned restore or unlock is settled: the process runs again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.cuda import CudaDriverCheckpointer
from ckptd.adapters.cuda.worker import CallWorker
from ckptd.domain import CudaState
from ckptd.errors import GpuFailed

from .stubs import CUresult, StubCu, fake_proc

PID = 4100
PEER = 4300  # another CUDA process
CPU = 4500  # a process without CUDA (no /dev/nvidia* mapped)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    proc = fake_proc(tmp_path / "proc", [PID, PEER, CPU], nvidia=(PID, PEER))
    made: list[CudaDriverCheckpointer] = []

    def build(cu: Any, **kwargs: Any) -> CudaDriverCheckpointer:
        adapter = CudaDriverCheckpointer(
            driver=cu, driver_bindings_version="13.4.4", proc=proc, cuda_checkpoint=None,
            **kwargs,
        )
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


class LongCheckpointCu(StubCu):
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


def test_a_cpu_only_probe_is_not_queued_behind_another_pids_checkpoint(make: Any) -> None:
    """The drain case: one job's checkpoint is long; another dump's probe of a CPU-only
    process (and a lock of another CUDA process) answers at once, not 'no answer from the
    driver' after the query bound."""
    cu = LongCheckpointCu(states={PID: 1, PEER: 0})
    gpu = make(cu, call_timeout_s=30, query_timeout_s=0.5)
    dumping = threading.Thread(target=gpu.checkpoint, args=(PID,))
    dumping.start()
    try:
        assert cu.entered.wait(5)
        assert gpu.uses_cuda(CPU) is False
        assert gpu.uses_cuda(PEER) is True
        gpu.lock(PEER, 1000)
        gpu.unlock(PEER)
        assert cu.states[PEER] == 0
    finally:
        cu.release.set()
        dumping.join(10)
    assert cu.states[PID] == 2


class BarrierCu(StubCu):
    """Each checkpoint waits until two checkpoints are in the driver at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.barrier = threading.Barrier(2, timeout=5)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[CUresult]:
        self.barrier.wait()
        return super().cuCheckpointProcessCheckpoint(pid, args)


def test_checkpoints_of_different_pids_are_in_the_driver_at_once(make: Any) -> None:
    cu = BarrierCu(states={PID: 1, PEER: 1})
    gpu = make(cu, call_timeout_s=20)
    errors: list[BaseException] = []

    def checkpoint(pid: int) -> None:
        try:
            gpu.checkpoint(pid)
        except BaseException as exc:
            errors.append(exc)

    callers = [threading.Thread(target=checkpoint, args=(p,)) for p in (PID, PEER)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(20)
    assert errors == []
    assert gpu.state(PID) is gpu.state(PEER) is CudaState.CHECKPOINTED
    lanes = {thread for name, args, thread in cu.calls
             if name == "cuCheckpointProcessCheckpoint"}
    assert len(lanes) == 2


def test_the_bound_counts_from_the_calls_start_not_its_submission() -> None:
    """Two calls on one pid, each shorter than its bound: the second waits for the first,
    then runs its own full time, and succeeds."""
    worker = CallWorker("test")
    try:
        first = threading.Thread(
            target=worker.run, args=(lambda: time.sleep(0.6), 5.0),
            kwargs={"call": "first", "pid": PID},
        )
        first.start()
        time.sleep(0.1)
        started = time.monotonic()
        answer = worker.run(lambda: (time.sleep(0.6), "done")[1], 1.0, call="second", pid=PID)
        assert answer == "done"
        assert time.monotonic() - started > 1.0, "it did wait behind the first call"
        first.join(5)
    finally:
        worker.close()


def test_a_call_that_never_started_says_what_it_was_queued_behind() -> None:
    worker = CallWorker("test")
    release = threading.Event()
    ran: list[str] = []
    try:
        first = threading.Thread(
            target=worker.run, args=(lambda: release.wait(10), 20.0),
            kwargs={"call": "cuCheckpointProcessCheckpoint", "pid": PID},
        )
        first.start()
        time.sleep(0.1)
        with pytest.raises(GpuFailed) as info:
            worker.run(lambda: ran.append("state"), 0.3, call="cuCheckpointProcessGetState",
                       pid=PID)
        err = info.value
        assert (err.code, err.pid, err.call) == ("QUEUED", PID, "cuCheckpointProcessGetState")
        assert f"queued behind cuCheckpointProcessCheckpoint for pid {PID}" in err.message
        assert "never reached the driver" in err.message
        assert "no answer from the driver" not in err.message
        assert worker.busy() == {}, "nothing was abandoned in the driver"
        release.set()
        first.join(5)
        assert worker.run(lambda: "later", 5.0, call="later", pid=PID) == "later"
        assert ran == [], "the dropped call never ran"
    finally:
        release.set()
        worker.close()


class LateCu(StubCu):
    """The first ``stuck`` call on ``PID`` blocks until ``release``, then answers
    ``answer`` (None: the driver's own result)."""

    def __init__(self, stuck: str, answer: CUresult | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stuck = stuck
        self.answer = answer
        self.release = threading.Event()
        self.once = True

    def _move(self, name: str, pid: int, args: Any) -> tuple[CUresult]:
        if name == self.stuck and pid == PID and self.once:
            self.once = False
            self.release.wait(30)
            if self.answer is not None:
                self._record(name, pid, args)
                return (self.answer,)
        return super()._move(name, pid, args)


def _wait_running(gpu: CudaDriverCheckpointer, cu: StubCu) -> None:
    deadline = time.monotonic() + 10
    while (cu.states[PID] != 0 or gpu._worker.busy()) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("stuck", "state", "answer"),
    [
        pytest.param("cuCheckpointProcessRestore", 2, None, id="late-restore-succeeds"),
        pytest.param("cuCheckpointProcessUnlock", 1, CUresult.CUDA_ERROR_NOT_READY,
                     id="late-unlock-fails"),
    ],
)
def test_a_late_restore_or_unlock_is_settled_to_running(
    make: Any, stuck: str, state: int, answer: CUresult | None
) -> None:
    """A resume whose restore (or unlock) answers after the bound: the caller got TIMEOUT;
    the late answer is kept and the process brought on to RUNNING, not left LOCKED."""
    cu = LateCu(stuck, answer, states={PID: state})
    gpu = make(cu, call_timeout_s=0.3)
    call = gpu.restore if stuck == "cuCheckpointProcessRestore" else gpu.unlock
    with pytest.raises(GpuFailed) as info:
        call(PID)
    assert info.value.code == "TIMEOUT"
    cu.release.set()
    _wait_running(gpu, cu)
    assert cu.states[PID] == 0, "brought back to RUNNING"
    assert gpu.state(PID) is CudaState.RUNNING
    unlocks = 1 if stuck == "cuCheckpointProcessRestore" else 2  # the settle's own unlock
    assert cu.names().count("cuCheckpointProcessUnlock") == unlocks
