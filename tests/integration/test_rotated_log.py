"""A log rotated after the checkpoint (Python's RotatingFileHandler), for real: a
leave-running checkpoint, the job writes on and its log rotates twice or more, it dies
(kill -9), and a restore brings it back. The restore follows the file that was open at the
checkpoint where the rotation moved it (docs/adr/0017): the rotated set ends bit for bit as an
uninterrupted run's (no step twice, none missing), and what was written after the checkpoint
is kept aside."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .support import Daemon, Procs, assert_ok, wait_until

pytestmark = pytest.mark.integration

JOB = Path(__file__).parent / "jobs" / "rotating.py"
STEPS = 80


def _run(directory: Path, interval_ms: int, procs: Procs) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    return procs.popen([sys.executable, str(JOB), str(directory), str(STEPS), str(interval_ms)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, start_new_session=True)


def _rotated_set(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()
            if p.name.startswith("job.log") and ".ckptd-" not in p.name}


def _rotated_names(directory: Path) -> set[str]:
    """The rotated set's names only: safe while the job runs (reading each file raced with a
    rotation renaming it, seen in a full run)."""
    return {p.name for p in directory.iterdir()
            if p.name.startswith("job.log") and ".ckptd-" not in p.name}


def _steps(directory: Path) -> int:
    return sum(b.count(b"\n") for b in _rotated_set(directory).values())


def test_restore_after_a_log_rotation_leaves_no_step_twice_in_the_rotated_set(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    ref = tmp_path / "ref"
    assert _run(ref, 0, procs).wait(timeout=60) == 0
    want = _rotated_set(ref)
    assert len(want) > 5  # it did rotate, several times

    job_dir = tmp_path / "job"
    job = _run(job_dir, 60, procs)
    wait_until((job_dir / "job.log.2").exists, 30, "two rotations before the dump")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    at_dump = len(_rotated_names(job_dir))
    wait_until(lambda: len(_rotated_names(job_dir)) >= at_dump + 2, 30, "two rotations after")
    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=10) == -signal.SIGKILL
    written = _steps(job_dir)

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    kept = [Path(k) for k in res["files_kept"]]
    # the new job.log, the file open at the checkpoint (moved to job.log.N), and the file(s)
    # the rotation created after the checkpoint: all kept aside, nothing destroyed
    assert len(kept) >= 3 and all(k.exists() for k in kept)
    assert _steps(job_dir) + sum(k.read_bytes().count(b"\n") for k in kept) >= written
    wait_until((job_dir / "finished").exists, 60, "the restored job to finish")
    got = _rotated_set(job_dir)
    lines = [line for data in got.values() for line in data.splitlines()]
    assert len(lines) == len(set(lines)) == STEPS + 1  # no step twice, none missing
    assert got == want  # bit for bit, names included
