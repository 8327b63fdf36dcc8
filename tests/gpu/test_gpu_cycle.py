"""Checkpoint and restore of CUDA processes through the real daemon and CLI.

For each workload of ``native/gpu`` (``fill``: raw CUDA, device memory rewritten every step;
``train.py``: PyTorch training), run once uninterrupted for the reference, then:

- dump (the job is killed), restore: lines before the dump + lines after the restore are the
  reference, bit for bit;
- dump ``--leave-running``: the job goes on without a gap; killed later, the checkpoint
  restores at the dump point and runs on to the reference's end;
- with two GPUs of the same model: restore onto the other GPU (``ckptctl restore --gpu-map
  OLD=NEW``) and the output still matches.

Skipped, with the reason, unless NVML sees a GPU, we are root, CRIU works (see
``conftest.py``) and the workload can run.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.nvml import NvmlInventory
from tests.gpu.gpu_support import gpu_inventory, workload_cmd
from tests.integration.support import (
    CKPTCTL,
    Daemon,
    LineReader,
    Procs,
    assert_continues_from_dump_point,
    assert_continuity,
    assert_ok,
    assert_running,
    assert_same_lines,
    reference,
    wait_for_done,
    with_interval,
)

pytestmark = pytest.mark.gpu

STEPS = 100  # at 50 ms a step: seconds of margin for the dump to start before the end
INTERVAL_MS = 50
FILL_MIB = 256
RESTORE_TIMEOUT_S = 180.0
WORKLOADS = {
    "fill": ("fill", "--steps", STEPS, "--mib", FILL_MIB),
    "train": ("train.py", "--steps", STEPS),
}


def command(which: str) -> list[str]:
    name, *args = WORKLOADS[which]
    return workload_cmd(str(name), *args)


class Job:
    """A workload with stdout on a pipe the test reads."""

    def __init__(self, procs: Procs, tmp_path: Path, cmd: list[str]) -> None:
        with open(tmp_path / "stderr", "wb") as err:
            self.proc = procs.popen(
                with_interval(cmd, INTERVAL_MS), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=err,
            )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid
        self.stderr = tmp_path / "stderr"

    def read(self, n: int) -> list[str]:
        try:
            return self.reader.read_lines(n, timeout=120.0)  # CUDA start-up takes a while
        except AssertionError as exc:
            raise AssertionError(f"{exc}; stderr: {self.stderr.read_text()[-2000:]}") from exc

    def kill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(timeout=30) == -signal.SIGKILL


def gpus_of(pid: int) -> set[str]:
    """UUIDs of the GPUs on which NVML sees ``pid`` hold memory."""
    return {u.uuid for u in NvmlInventory().inventory().uses if u.pid == pid}


def check_gpu_facts(ck: dict[str, Any], pid: int, device_bytes: int = 0) -> None:
    """The checkpoint records ``pid`` as a CUDA process and holds its device memory (moved
    into host memory before CRIU's dump)."""
    gpu = ck.get("gpu")
    assert gpu, f"checkpoint {ck['id']} has no GPU facts: the daemon did not see CUDA"
    assert pid in gpu["cuda_pids"]
    size = max(int(ck.get("bytes", 0)), int(ck.get("bytes_logical", 0)))
    assert size >= device_bytes, (
        f"checkpoint of pid {pid} is {size} bytes: the {device_bytes} bytes of device memory "
        "cannot be in it"
    )


def restore(daemon: Daemon, procs: Procs, target: object, *extra: object) -> dict[str, Any]:
    res = assert_ok(
        daemon.ctl("restore", target, *extra, timeout=RESTORE_TIMEOUT_S), f"restore {target}"
    )
    procs.add(res["pid"])
    return dict(res)


@pytest.mark.parametrize("which", sorted(WORKLOADS))
def test_dump_kill_restore_continues_bit_for_bit(
    gpu_daemon: Daemon, procs: Procs, tmp_path: Path, which: str
) -> None:
    cmd = command(which)
    ref = reference(with_interval(cmd, 0), timeout=300)
    job = Job(procs, tmp_path, cmd)
    job.read(5)
    assert gpus_of(job.pid), f"NVML does not see {which} (pid {job.pid}) on any GPU"

    ck = assert_ok(gpu_daemon.ctl("dump", job.pid, timeout=RESTORE_TIMEOUT_S), "dump")
    assert ck["pid"] == job.pid
    check_gpu_facts(ck, job.pid, FILL_MIB * 2**20 if which == "fill" else 0)
    pre = job.reader.read_to_eof(timeout=60)
    assert job.proc.wait(timeout=30) == -signal.SIGKILL, "the dump did not kill the workload"

    res = restore(gpu_daemon, procs, ck["id"])
    assert res["pid"] == job.pid, "CRIU restores the tree with its original pids"
    post = wait_for_done(Path(res["output_path"]), timeout=RESTORE_TIMEOUT_S)
    assert_continuity(pre, post, ref)


@pytest.mark.parametrize("which", sorted(WORKLOADS))
def test_leave_running_then_restore_from_the_dump_point(
    gpu_daemon: Daemon, procs: Procs, tmp_path: Path, which: str
) -> None:
    cmd = command(which)
    ref = reference(with_interval(cmd, 0), timeout=300)
    job = Job(procs, tmp_path, cmd)
    job.read(5)

    low = len(job.reader.drain())
    ck = assert_ok(
        gpu_daemon.ctl("dump", job.pid, "--leave-running", timeout=RESTORE_TIMEOUT_S),
        "dump --leave-running",
    )
    high = len(job.reader.drain())
    assert ck["leave_running"] is True
    check_gpu_facts(ck, job.pid)
    assert_running(job.pid, "after a --leave-running dump")

    seen = job.read(high + 5)  # the job computes on its GPU again, no gap, no repeat
    assert_same_lines(seen, ref[: len(seen)], f"output of {which} left running")
    assert gpus_of(job.pid), "the job left running is back on its GPU"
    assert not seen[-1].startswith("done"), "the job finished too early for the test"
    job.kill()

    res = restore(gpu_daemon, procs, ck["id"])
    assert res["pid"] == job.pid
    post = wait_for_done(Path(res["output_path"]), timeout=RESTORE_TIMEOUT_S)
    assert_continues_from_dump_point(post, ref, low, high)


def skip_unless_gpu_map_flag() -> None:
    """Skip unless ``ckptctl restore`` takes ``--gpu-map OLD=NEW``."""
    helped = subprocess.run(
        [str(CKPTCTL), "restore", "--help"], capture_output=True, text=True, timeout=60,
        check=False,
    )
    if "--gpu-map" not in helped.stdout:
        pytest.skip("ckptctl restore has no --gpu-map option: GPU remapping is not exposed yet")


@pytest.mark.parametrize("which", sorted(WORKLOADS))
def test_restore_onto_another_gpu(
    gpu_daemon: Daemon, procs: Procs, tmp_path: Path, which: str
) -> None:
    inv = gpu_inventory()
    if len(inv.gpus) < 2:
        pytest.skip(f"restoring onto another GPU needs 2 GPUs; this node has {len(inv.gpus)}")
    if inv.cuda_version < 13000:
        pytest.skip(f"restoring onto another GPU needs an r580 driver (CUDA 13.0); "
                    f"this one is {inv.driver_version}")
    skip_unless_gpu_map_flag()
    cmd = command(which)
    ref = reference(with_interval(cmd, 0), timeout=300)
    job = Job(procs, tmp_path, cmd)
    job.read(5)
    used = gpus_of(job.pid)
    assert len(used) == 1, f"{which} should use one GPU, NVML sees {used}"
    (old,) = used
    model = inv.by_uuid()[old].name
    others = [g.uuid for g in inv.gpus if g.uuid != old and g.name == model]
    if not others:
        pytest.skip(f"no second {model} to restore onto")
    new = others[0]

    ck = assert_ok(gpu_daemon.ctl("dump", job.pid, timeout=RESTORE_TIMEOUT_S), "dump")
    pre = job.reader.read_to_eof(timeout=60)
    assert job.proc.wait(timeout=30) == -signal.SIGKILL

    res = restore(gpu_daemon, procs, ck["id"], "--gpu-map", f"{old}={new}")
    assert res["pid"] == job.pid
    assert gpus_of(res["pid"]) <= {new}, "the restored process must not be back on the old GPU"
    post = wait_for_done(Path(res["output_path"]), timeout=RESTORE_TIMEOUT_S)
    assert_continuity(pre, post, ref)
