"""io_uring, which CRIU cannot checkpoint: a dump by pid of a process holding one is refused
before anything is frozen; the same program launched by ``ckptctl run`` gets ENOSYS from
io_uring_setup (the launcher's seccomp filter), is checkpointed and restored, and keeps the
filter after the restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .support import (
    CKPTCTL,
    Daemon,
    LineReader,
    Procs,
    assert_ok,
    assert_one_line_error,
    assert_running,
    assert_same_lines,
    is_alive,
    proc_state,
    wait_for_done,
    wait_for_lines,
    wait_until,
)

pytestmark = pytest.mark.integration

URING_JOB = Path(__file__).resolve().parents[1] / "uring_job.py"
EXIT_USAGE, EXIT_TERMINATED = 2, 143
STEPS, PERIOD = 80, 0.03


def job_cmd(*args: object) -> list[str]:
    return [sys.executable, str(URING_JOB), *map(str, args)]


def seccomp_mode(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line.split()[1] for line in status if line.startswith("Seccomp:"))


def holds_io_uring(pid: int) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    links = {os.readlink(fd) for fd in fds.iterdir()}
    return ("anon_inode:[io_uring]" in links
            or "anon_inode:[io_uring]" in Path(f"/proc/{pid}/maps").read_text())


@pytest.mark.parametrize("keep", ["fd", "mapped"])
def test_dump_by_pid_of_a_process_holding_an_io_uring_is_refused_before_freezing(
    daemon: Daemon, procs: Procs, keep: str
) -> None:
    proc = procs.popen(job_cmd("--keep", keep), stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    first = reader.read_lines(1)[0]
    if first != "io_uring_setup: fd":
        pytest.skip(f"io_uring is not available on this node: {first}")
    reader.read_lines(3)
    assert holds_io_uring(proc.pid)
    comm = Path(f"/proc/{proc.pid}/comm").read_text().strip()

    res = daemon.ctl("dump", proc.pid)
    assert_one_line_error(
        res, EXIT_USAGE,
        f"pid {proc.pid} ({comm}) holds an io_uring instance, which CRIU cannot checkpoint; "
        "launch it through `ckptctl run` (which keeps io_uring away from jobs), or turn the "
        "library's io_uring use off (e.g. PyTorch: USE_LIBUV=0 for init_method=env:// ranks)",
    )
    assert proc_state(proc.pid) not in ("T", "t"), "the process must not be left stopped"
    before = len(reader.drain())
    reader.read_lines(before + 3, timeout=5)  # it goes on
    assert_running(proc.pid)
    assert daemon.checkpoints_of(proc.pid) == []


def launch(procs: Procs, daemon: Daemon, out: Path, *run_args: str) -> subprocess.Popen[bytes]:
    """``ckptctl run ... -- uring_job.py`` with the job's stdout appended to ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return procs.popen(
            [str(CKPTCTL), "--socket", str(daemon.socket), "run", *run_args, "--",
             *job_cmd("--steps", STEPS, "--period", PERIOD)],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.PIPE,
        )
    finally:
        os.close(fd)


def job_of(launcher: subprocess.Popen[bytes]) -> int:
    path = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    wait_until(lambda: path.read_text().split(), 10, "ckptctl run to start the job")
    return int(path.read_text().split()[0])


def test_a_job_launched_by_run_gets_enosys_and_is_checkpointed_and_restored(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    ref = subprocess.run(job_cmd("--steps", STEPS, "--period", 0), capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    ref = ["io_uring_setup: ENOSYS", *ref[1:]]
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "uring")
    job = job_of(launcher)
    assert wait_for_lines(out, 5)[0] == "io_uring_setup: ENOSYS"
    assert seccomp_mode(job) == "2"
    assert not holds_io_uring(job)

    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == EXIT_TERMINATED, err
    assert b"checkpointed as ck-" in err, err
    assert not is_alive(job)

    res = assert_ok(daemon.ctl("resume", "uring"), "resume")
    restored = procs.add(res["restored"][0]["pid"])
    assert seccomp_mode(restored) == "2", "the restored job keeps the filter"
    assert_same_lines(wait_for_done(out), ref, "the job's output, checkpointed and restored")
    assert_ok(daemon.ctl("policy", "clear", "uring"), "policy clear")


def test_allow_io_uring_lets_the_job_make_one_and_then_its_checkpoint_is_refused(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "uring-allowed", "--allow-io-uring")
    job = job_of(launcher)
    first = wait_for_lines(out, 2)[0]
    if first != "io_uring_setup: fd":
        pytest.skip(f"io_uring is not available on this node: {first}")
    assert seccomp_mode(job) == "0"

    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    lines = err.decode().splitlines()
    assert lines[0] == ("ckptctl: --allow-io-uring: the job may use io_uring, and then cannot "
                        "be checkpointed")
    assert "checkpoint of uring-allowed before termination failed" in lines[1], lines
    assert f"pid {job} (" in lines[1] and "holds an io_uring instance" in lines[1], lines
    assert launcher.returncode == EXIT_TERMINATED  # the job's own status: killed by SIGTERM
    assert not is_alive(job)
