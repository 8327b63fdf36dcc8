"""Issue 23, point 2 (docs/adr/0019) on a real process: a leave-running dump by real CRIU, the
threads held by the real ``PtraceThreadHold``, the CUDA driver faked (``FakeGpu``: its
restore thread one of the job's real threads). The job is 4 C threads, each adding to its
own counter in a shared file: between CRIU's end and the CUDA resume no counter moves;
while CUDA is restored and unlocked only the restore thread's does; after the dump all do,
and nothing is left stopped or traced."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from ckptd.adapters.clock import SystemClock
from ckptd.adapters.criu import CriuSwrk
from ckptd.adapters.procfs import ProcFsTable, ProcNodeInspector
from ckptd.adapters.procfs.threadhold import PtraceThreadHold
from ckptd.adapters.storage import FileJournal
from ckptd.core.config import CoreConfig
from ckptd.core.dump import DumpRecipe
from ckptd.core.gpu import GpuSteps
from ckptd.core.parts import RecipeParts
from ckptd.core.ports import CriuHooks
from ckptd.domain import CheckpointRecord, CudaState, DumpRequest
from ckptd.domain.model import ROOT
from ckptd.errors import GpuFailed
from ckptd.testing import FakeGpu, MemoryStore

from .conftest import criu_path
from .support import Procs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler"),
]

THREADS = 4
QUIET_S = 0.3
"""How long a counter is watched to say it does not move (a running thread adds ~1e5/s)."""

COUNTERS = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
static volatile uint64_t *slots;
static void *run(void *arg) {
    long i = (long)arg;
    slots[4 + i] = (uint64_t)syscall(SYS_gettid);
    for (;;) { slots[i]++; for (volatile int k = 0; k < 1000; k++) {} }
    return 0;
}
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDWR);
    slots = mmap(0, 64, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    pthread_t t[4];
    for (long i = 0; i < 4; i++) pthread_create(&t[i], 0, run, (void *)i);
    for (;;) pause();
}
"""


class Counters:
    """The job: 4 counting threads; their counters and tids read through the shared file."""

    def __init__(self, binary: Path, tmp: Path, procs: Procs) -> None:
        path = tmp / "slots"
        path.write_bytes(bytes(64))
        self.proc = procs.popen([str(binary), str(path)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._f = open(path, "r+b")  # noqa: SIM115
        self._m = mmap.mmap(self._f.fileno(), 64)
        deadline = time.monotonic() + 10
        while not all(self.tids()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(self.tids()), "the 4 threads did not start"

    def counts(self) -> list[int]:
        return list(struct.unpack_from("<4Q", self._m, 0))

    def tids(self) -> list[int]:
        return list(struct.unpack_from("<4Q", self._m, 32))

    def moving(self) -> list[bool]:
        before = self.counts()
        time.sleep(QUIET_S)
        return [a > b for a, b in zip(self.counts(), before, strict=True)]

    def status(self, field: str) -> str:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return line.split(":", 1)[1].strip()
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def traced(self) -> list[int]:
        """The job's threads with a tracer."""
        out = []
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            status = Path(f"/proc/{self.proc.pid}/task/{tid}/status").read_text()
            if "\nTracerPid:\t0\n" not in status:
                out.append(int(tid))
        return out

    def close(self) -> None:
        self._m.close()
        self._f.close()


@pytest.fixture(scope="module")
def counters_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("counters")
    (d / "c.c").write_text(COUNTERS)
    subprocess.run(["cc", "-O1", "-pthread", "-o", str(d / "counters"), str(d / "c.c")],
                   check=True)
    return d / "counters"


@pytest.fixture
def job(counters_bin: Path, tmp_path: Path, procs: Procs) -> Iterator[Counters]:
    j = Counters(counters_bin, tmp_path, procs)
    try:
        yield j
    finally:
        j.close()


class Seen:
    """What the probes saw, by moment."""

    def __init__(self) -> None:
        self.frozen: list[int] = []
        self.at_commit: list[int] = []
        self.commit_state = ""
        self.commit_moving: list[bool] = []
        self.restore_moving: list[bool] = []
        self.restore_counts: list[int] = []


class Probe(CriuHooks):
    def __init__(self, job: Counters, seen: Seen) -> None:
        self.job, self.seen = job, seen

    def post_dump(self, pid: int) -> None:
        self.seen.frozen = self.job.counts()  # CRIU holds the tree: nothing runs


def recipe(tmp_path: Path, job: Counters, seen: Seen, fake: FakeGpu) -> DumpRecipe:
    path = criu_path()
    assert path is not None
    store = MemoryStore(tmp_path / "store")
    commit = store.commit

    def probing_commit(record: CheckpointRecord) -> CheckpointRecord:
        # CRIU has detached: each thread wakes in the kernel and stops on the SIGSTOP before
        # it returns to user space (runnable, "R", until the scheduler gets to it)
        deadline = time.monotonic() + 5
        while not job.status("State").startswith("T") and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.commit_state = job.status("State")
        seen.commit_moving = job.moving()
        seen.at_commit = job.counts()
        return commit(record)

    store.commit = probing_commit  # type: ignore[method-assign]
    restore = fake.restore

    def probing_restore(pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        seen.restore_moving = job.moving()  # held but the restore thread, continued
        seen.restore_counts = job.counts()
        restore(pid, gpu_map)

    fake.restore = probing_restore  # type: ignore[method-assign]
    clock = SystemClock()
    config = CoreConfig(node="test-node", daemon_pid=os.getpid(), work_dir=tmp_path / "work",
                        output_dir=tmp_path / "out")
    return DumpRecipe(RecipeParts(
        criu=CriuSwrk(path, plugin_dir=tmp_path / "plugins"), processes=ProcFsTable(),
        store=store, journal=FileJournal(tmp_path / "journal"), clock=clock, config=config,
        gpu=GpuSteps(fake, fake, clock, 10_000, threads=PtraceThreadHold()),
        node=ProcNodeInspector(), hooks=Probe(job, seen),
    ))


def fake_gpu(job: Counters) -> FakeGpu:
    fake = FakeGpu()
    fake.add_cuda_process(job.proc.pid)
    fake.restore_tids[job.proc.pid] = job.tids()[0]  # the driver's thread: counter 0
    return fake


def dump(r: DumpRecipe, job: Counters) -> CheckpointRecord:
    ctx = r.new_context(ROOT, DumpRequest(job.proc.pid, leave_running=True))
    return r.run(ctx, lambda _p: None)


def test_a_leave_running_dump_holds_the_job_until_its_cuda_is_back(
        tmp_path: Path, job: Counters) -> None:
    seen, fake = Seen(), fake_gpu(job)
    record = dump(recipe(tmp_path, job, seen, fake), job)

    assert record.leave_running and record.gpu is not None
    assert seen.frozen, "CRIU's post-dump hook ran"
    # CRIU has ended (let-go), the commit runs: the job is stopped, nothing of it ran
    assert seen.commit_state.startswith("T"), seen.commit_state
    assert seen.commit_moving == [False] * THREADS
    assert seen.at_commit == seen.frozen
    # the CUDA restore: only the driver's restore thread runs
    assert seen.restore_moving == [True, False, False, False]
    assert seen.restore_counts[1:] == seen.frozen[1:]
    # after the dump: everything runs, nothing stopped or traced, CUDA back
    assert fake.cuda_state(job.proc.pid) is CudaState.RUNNING
    assert job.moving() == [True] * THREADS
    assert not job.status("State").startswith(("T", "t")) and job.traced() == []


def test_a_failed_cuda_resume_keeps_the_checkpoint_and_lets_the_job_run(
        tmp_path: Path, job: Counters) -> None:
    seen, fake = Seen(), fake_gpu(job)
    fake.fail_restore.add(job.proc.pid)
    r = recipe(tmp_path, job, seen, fake)
    with pytest.raises(GpuFailed, match="is committed and kept") as info:
        dump(r, job)
    assert info.value.code == "RESUME_FAILED"
    assert seen.commit_moving == [False] * THREADS
    assert len(r._store.list()) == 1
    assert job.moving() == [True] * THREADS
    assert not job.status("State").startswith(("T", "t")) and job.traced() == []
