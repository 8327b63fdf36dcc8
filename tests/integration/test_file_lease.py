"""Issue 34 (6): a job holding a write lease (``F_SETLEASE``) on a file it writes. A
leave-running checkpoint freezes it for what raw CRIU's does, not the kernel's lease-break
time (45 s: an open(2) of the leased file, by ckptd's capture or CRIU's build-id check,
breaks the lease and waits for a holder that is frozen); the live job keeps its lease, and a
restore after kill -9 brings it back with its lease, its output continuing bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .support import Daemon, Procs, assert_ok, wait_until

pytestmark = pytest.mark.integration

LEASER = Path(__file__).parent / "jobs" / "leaser.py"
STEPS = 40


def _run(directory: Path, interval_ms: int, procs: Procs,
         *mode: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "out.txt", "wb") as out:
        return procs.popen(
            [sys.executable, str(LEASER), str(directory / "data.bin"), str(STEPS),
             str(interval_ms), *mode],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _leases(path: Path) -> list[str]:
    """/proc/locks' lease lines on ``path``'s inode (``MAJOR:MINOR:INODE``, hex device)."""
    st = os.stat(path)
    inode = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return [line for line in Path("/proc/locks").read_text().splitlines()
            if " LEASE " in line and inode in line]


def test_a_leased_file_is_captured_without_breaking_the_lease_or_waiting_for_it(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    break_time = int(Path("/proc/sys/fs/lease-break-time").read_text())
    assert break_time >= 10, "the node's lease-break time is too short to tell a wait apart"
    ref = tmp_path / "ref"
    assert _run(ref, 0, procs).wait(timeout=60) == 0
    want = {name: (ref / name).read_bytes() for name in ("out.txt", "data.bin")}
    assert b"lease write breaks 0\ndone\n" in want["out.txt"]

    job_dir = tmp_path / "job"
    job = _run(job_dir, 100, procs)
    wait_until(lambda: _lines(job_dir / "out.txt") >= 5, 30, "5 steps before the checkpoint")
    data = job_dir / "data.bin"
    assert [line.split()[1:4] for line in _leases(data)] == [["LEASE", "ACTIVE", "WRITE"]]

    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    assert ck["frozen_s"] < 5, ck  # not the lease-break time
    assert str(data) in [f["path"] for f in ck["files"]]
    # the live job still holds its write lease, nothing was sent to break it
    assert [line.split()[1:4] for line in _leases(data)] == [["LEASE", "ACTIVE", "WRITE"]]
    seen = _lines(job_dir / "out.txt")
    wait_until(lambda: _lines(job_dir / "out.txt") >= seen + 3, 30, "steps after it")
    assert b"breaks 1" not in (job_dir / "out.txt").read_bytes()

    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=10) == -signal.SIGKILL
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: (job_dir / "out.txt").read_bytes().endswith(b"done\n"), 60,
               "the restored job to finish")
    time.sleep(0.1)
    # every line, the restored job's too, says it held its write lease and was sent no break
    for name, content in want.items():
        assert (job_dir / name).read_bytes() == content, name


def test_a_file_leased_through_a_write_only_descriptor_is_left_to_criu_and_keeps_its_lease(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """Only an open could read it (its description cannot be read), and an open breaks the
    lease: it is not captured, and the dump says so (CRIU's size check guards its restore)."""
    job_dir = tmp_path / "job"
    job = _run(job_dir, 100, procs, "wronly")
    wait_until(lambda: _lines(job_dir / "out.txt") >= 3, 30, "3 steps before the checkpoint")
    data = job_dir / "data.bin"
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    assert ck["frozen_s"] < 5, ck
    assert [line.split()[1:4] for line in _leases(data)] == [["LEASE", "ACTIVE", "WRITE"]]
    assert str(data) not in [f["path"] for f in ck["files"]]
    assert [s for s in ck["files_skipped"] if s.startswith(f"{data} ")] == [
        f"{data} (leased by the job through a write-only descriptor: reading it would break "
        "the lease; CRIU checks its size at the restore)"]
    seen = _lines(job_dir / "out.txt")
    wait_until(lambda: _lines(job_dir / "out.txt") >= seen + 2, 30, "steps after it")
    assert b"breaks 1" not in (job_dir / "out.txt").read_bytes()
    assert b"lease none" not in (job_dir / "out.txt").read_bytes()
