"""Contract of ``ThreadHold`` (docs/adr/0019): ``PtraceThreadHold`` on a real process of 4
threads, each adding to its own counter in a shared file (C: no interpreter lock a held
thread could keep), and ``FakeThreadHold``. Needs root (ptrace of another process) and cc."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.threadhold import PtraceThreadHold
from ckptd.core.ports import ThreadHold
from ckptd.domain import PidState
from ckptd.errors import PreconditionFailed, ProcessNotFound
from ckptd.testing import FakeProcessTable, FakeThreadHold

THREADS = 4
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
    pthread_t t[4];
    for (long i = 0; i < 4; i++) pthread_create(&t[i], 0, run, (void *)i);
    for (;;) pause();
}
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("cc") is None,
                                reason="needs root (ptrace) and a C compiler")


@pytest.fixture(scope="module")
def counters_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("counters")
    (d / "c.c").write_text(COUNTERS)
    subprocess.run(["cc", "-O1", "-pthread", "-o", str(d / "counters"), str(d / "c.c")],
                   check=True)
    return d / "counters"


class Job:
    def __init__(self, binary: Path, tmp: Path) -> None:
        self.path = tmp / "slots"
        self.path.write_bytes(bytes(64))
        self.proc = subprocess.Popen([str(binary), str(self.path)])
        self._f = open(self.path, "r+b")  # noqa: SIM115
        self._m = mmap.mmap(self._f.fileno(), 64)
        deadline = time.monotonic() + 10
        while not all(self.tids()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(self.tids()), "the 4 threads did not start"

    def counts(self) -> list[int]:
        return list(struct.unpack_from("<4Q", self._m, 0))

    def tids(self) -> list[int]:
        return list(struct.unpack_from("<4Q", self._m, 32))

    def advanced(self, wait_s: float = 0.3) -> list[bool]:
        before = self.counts()
        time.sleep(wait_s)
        return [a > b for a, b in zip(self.counts(), before, strict=True)]

    def state(self, tid: int) -> str:
        stat = Path(f"/proc/{self.proc.pid}/task/{tid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._m.close()
        self._f.close()


@pytest.fixture
def job(counters_bin: Path, tmp_path: Path) -> Iterator[Job]:
    j = Job(counters_bin, tmp_path)
    try:
        yield j
    finally:
        j.close()


def _is_thread_holds(a: PtraceThreadHold, b: FakeThreadHold) -> tuple[ThreadHold, ThreadHold]:
    return a, b


@needs_root
def test_held_threads_stop_the_free_one_runs_and_all_run_after_release(job: Job) -> None:
    holder = PtraceThreadHold()
    free = job.tids()[2]
    held = holder.hold(job.proc.pid, free)
    try:
        tasks = {int(t) for t in os.listdir(f"/proc/{job.proc.pid}/task")}
        assert set(held) == tasks - {free}
        assert free not in held and job.proc.pid in held
        assert job.advanced() == [False, False, True, False]
        assert [job.state(t) for t in job.tids()][:2] == ["t", "t"]
    finally:
        holder.release(job.proc.pid)
    assert job.advanced() == [True] * THREADS
    holder.release(job.proc.pid)  # nothing held: nothing done


@needs_root
def test_a_stopped_process_held_then_continued_runs_only_its_free_thread(job: Job) -> None:
    """The restore's order: the tree stopped (CRIU's leave_stopped), held, SIGCONT: only
    the free thread runs; released: all run."""
    os.kill(job.proc.pid, signal.SIGSTOP)
    time.sleep(0.1)
    holder = PtraceThreadHold()
    free = job.tids()[0]
    holder.hold(job.proc.pid, free)
    try:
        assert job.advanced() == [False] * THREADS
        os.kill(job.proc.pid, signal.SIGCONT)
        assert job.advanced() == [True, False, False, False]
    finally:
        holder.release(job.proc.pid)
    assert job.advanced() == [True] * THREADS


@needs_root
def test_a_holder_that_dies_releases_the_threads(job: Job) -> None:
    script = (
        "import sys, time\n"
        "from ckptd.adapters.procfs.threadhold import PtraceThreadHold\n"
        "holder = PtraceThreadHold()  # kept: its lane's thread is the tracer\n"
        "holder.hold(int(sys.argv[1]), int(sys.argv[2]))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, str(job.proc.pid),
                               str(job.tids()[1])], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert job.advanced() == [False, True, False, False]
    finally:
        holder.kill()
        holder.wait()
    assert job.advanced() == [True] * THREADS


@needs_root
def test_a_hold_refuses_what_it_cannot_hold(job: Job) -> None:
    holder = PtraceThreadHold()
    with pytest.raises(PreconditionFailed, match="not one of its threads"):
        holder.hold(job.proc.pid, 1)
    holder.hold(job.proc.pid, job.tids()[0])
    try:
        with pytest.raises(PreconditionFailed, match="already held"):
            holder.hold(job.proc.pid, job.tids()[0])
        other = PtraceThreadHold()  # another tracer holds them: refused, nothing left held
        with pytest.raises(PreconditionFailed, match="cannot hold thread"):
            other.hold(job.proc.pid, job.tids()[1])
    finally:
        holder.release(job.proc.pid)
    assert job.advanced() == [True] * THREADS
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(ProcessNotFound):
        holder.hold(gone.pid, gone.pid)


def test_the_fake_records_what_is_held() -> None:
    table = FakeProcessTable()
    table.add_process(10, comm="job")
    fake = FakeThreadHold(table)
    assert fake.hold(10, 99) == (10,)
    assert fake.held == {10: 99}
    with pytest.raises(PreconditionFailed, match="already held"):
        fake.hold(10, 99)
    fake.release(10)
    fake.release(10)
    assert fake.held == {} and fake.history == [("hold", 10, 99), ("release", 10, 0)]
    with pytest.raises(ProcessNotFound):
        fake.hold(11, 11)
    table.processes[10].state = PidState.ZOMBIE
    with pytest.raises(ProcessNotFound):
        fake.hold(10, 99)
