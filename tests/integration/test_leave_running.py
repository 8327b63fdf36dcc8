"""``--leave-running``: the job runs on untouched; a restore later starts from the dump point.

The restored process restarts at the step after the dump point, which lies between the lines
printed before the dump was asked for and those printed when it returned. Its output must be
the reference from that step to the end, exactly.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continues_from_dump_point,
    assert_ok,
    assert_running,
    assert_same_lines,
    reference,
    wait_for_done,
    wait_state,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 80  # 4 s at INTERVAL: three dumps fit in that window even on a loaded machine
INTERVAL = 50


class Job:
    def __init__(self, procs: Procs, tmp_path: Path, cmd: list[str]) -> None:
        with open(tmp_path / "stderr", "wb") as err:
            self.proc = procs.popen(
                with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=err,
            )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid

    def dump_leave_running(self, daemon: Daemon) -> tuple[dict[str, Any], int, int]:
        """(checkpoint, lines printed before the dump, lines printed when it had returned)."""
        low = len(self.reader.drain())
        ck = assert_ok(daemon.ctl("dump", self.pid, "--leave-running"), "dump --leave-running")
        high = len(self.reader.drain())
        assert ck["leave_running"] is True
        assert_running(self.pid, "after a --leave-running dump")
        return ck, low, high

    def kill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(timeout=10) == -signal.SIGKILL


def restore_and_check(
    daemon: Daemon, procs: Procs, target: object, ref: list[str], low: int, high: int
) -> dict[str, Any]:
    res = assert_ok(daemon.ctl("restore", target), f"restore {target}")
    procs.add(res["pid"])
    post = wait_for_done(Path(res["output_path"]), timeout=60)
    assert_continues_from_dump_point(post, ref, low, high)
    return res


def test_leave_running_keeps_the_job_running_and_restores_from_the_dump_point(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd = workload("counter", "--steps", STEPS, "--mem-mib", 4)
    ref = reference(with_interval(cmd, 0))
    job = Job(procs, tmp_path, cmd)
    job.reader.read_lines(5)
    ck, low, high = job.dump_leave_running(daemon)

    # the same process goes on, with no gap and no repeat
    seen = job.reader.read_lines(high + 5)
    assert_running(job.pid, "a while after the dump")
    assert_same_lines(seen, ref[: len(seen)], "output of the job left running")
    assert not seen[-1].startswith("done"), "the job finished too early for the test"
    job.kill()

    res = restore_and_check(daemon, procs, ck["id"], ref, low, high)
    assert res["pid"] == job.pid


def test_three_checkpoints_restore_the_first_then_the_latest(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    job = Job(procs, tmp_path, cmd)
    dumps = []
    for n in (4, 10, 16):
        job.reader.read_lines(max(n, len(job.reader.lines) + 2))
        dumps.append(job.dump_leave_running(daemon))
    listed = daemon.checkpoints_of(job.pid)
    ids = [ck["id"] for ck, _, _ in dumps]
    assert [c["id"] for c in listed] == ids, "oldest first, all three"
    assert [c["parent_id"] for c in listed] == ["", ids[0], ids[1]]
    points = [(low, high) for _, low, high in dumps]
    assert points[0][1] < points[2][0], "the first and last dumps are at different steps"
    job.kill()

    first, low, high = dumps[0]
    res = restore_and_check(daemon, procs, first["id"], ref, low, high)
    assert res["id"] == ids[0]
    procs.cleanup()  # kill it (it may have finished already), so its pid is free again
    wait_state(job.pid, [None])

    last, low, high = dumps[2]
    res = restore_and_check(daemon, procs, job.pid, ref, low, high)
    assert res["id"] == ids[2], "`ckptctl restore <pid>` restores the latest checkpoint"
    assert res["pid"] == job.pid
    del last
