"""Contract of ``CudaProcessFacts`` (issue 23, 6): ``ProcCudaFacts`` on real child processes
(one maps a file named ``libnccl.so.2``, as a process linked against NCCL does; one starts
with ``CUDA_CHECKPOINT_JOB_FILE``) and ``FakeGpu`` told the same facts. No GPU, no root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs import ProcCudaFacts
from ckptd.core.ports import CudaProcessFacts
from ckptd.domain import PidState
from ckptd.testing import FakeGpu, FakeProcessTable

MAPPER = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
time.sleep(60)
"""


class FactsHarness:
    """``spawn(nccl, job_file)``: a live process with those facts; ``gone()``: a pid of no
    process."""

    facts: CudaProcessFacts

    def spawn(self, *, nccl: bool = False, job_file: str = "") -> int:
        raise NotImplementedError

    def gone(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RealFacts(FactsHarness):
    def __init__(self, tmp: Path) -> None:
        self.facts = ProcCudaFacts()
        self._tmp = tmp
        self._children: list[subprocess.Popen[bytes]] = []

    def spawn(self, *, nccl: bool = False, job_file: str = "") -> int:
        lib = self._tmp / "lib" / ("libnccl.so.2" if nccl else "libother.so.1")
        lib.parent.mkdir(exist_ok=True)
        lib.write_bytes(b"\0" * 4096)
        env = {k: v for k, v in os.environ.items() if k != "CUDA_CHECKPOINT_JOB_FILE"}
        if job_file:
            env["CUDA_CHECKPOINT_JOB_FILE"] = job_file
        proc = subprocess.Popen(
            [sys.executable, "-c", MAPPER, str(lib)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
        )
        self._children.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"mapped\n"
        return proc.pid

    def gone(self) -> int:
        proc = subprocess.Popen(["true"])
        proc.wait()
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc.pid

    def close(self) -> None:
        for proc in self._children:
            proc.kill()
            proc.wait()


class FakeFacts(FactsHarness):
    def __init__(self, tmp: Path) -> None:
        self._table = FakeProcessTable()
        self.fake = FakeGpu(processes=self._table)
        self.facts = self.fake
        self._next = 500

    def spawn(self, *, nccl: bool = False, job_file: str = "") -> int:
        self._next += 1
        pid = self._next
        self._table.add_process(pid)
        if nccl:
            self.fake.nccl.add(pid)
        if job_file:
            self.fake.launch_jobs[pid] = job_file
        return pid

    def gone(self) -> int:
        pid = 99_000
        assert self._table.status(pid).state is PidState.FREE
        return pid


@pytest.fixture(params=["real", "fake"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FactsHarness]:
    made = RealFacts(tmp_path) if request.param == "real" else FakeFacts(tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_a_plain_process_shows_nothing(harness: FactsHarness) -> None:
    pid = harness.spawn()
    fact = harness.facts.cuda_facts(pid)
    assert (fact.pid, fact.nccl, fact.launch_job, fact.unreadable) == (pid, False, "", "")


def test_a_process_mapping_libnccl(harness: FactsHarness) -> None:
    pid = harness.spawn(nccl=True)
    fact = harness.facts.cuda_facts(pid)
    assert fact.nccl is True and fact.launch_job == "" and fact.unreadable == ""


def test_a_launch_job_names_its_job_file(harness: FactsHarness) -> None:
    pid = harness.spawn(job_file="/run/ckpt/job.json")
    fact = harness.facts.cuda_facts(pid)
    assert fact.launch_job == "/run/ckpt/job.json" and fact.nccl is False


def test_a_gone_process_is_unreadable_and_never_raises(harness: FactsHarness) -> None:
    pid = harness.gone()
    fact = harness.facts.cuda_facts(pid)
    assert fact.pid == pid and fact.unreadable
    assert (fact.nccl, fact.launch_job) == (False, "")
