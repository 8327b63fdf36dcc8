"""Issue 33 (4): ghost files are bounded per dump, not only per file. A real job holds three
deleted-but-open files in /dev/shm (shared memory as PyTorch leaves it), each under
``ghost_limit`` and together over ``ghost_total_limit``: the dump is refused in one line
naming that setting, before anything is frozen, and the job runs on (the daemon before this
fix dumped them all, each within its limit, into the RAM staging)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .support import (
    VENV_PYTHON,
    Daemon,
    Procs,
    assert_one_line_error,
    assert_running,
    start_detached,
)

pytestmark = pytest.mark.integration

MiB = 1 << 20
HOLDER = r"""
import os, sys, time
fds = []
for i in range(3):  # 3 MiB each, written (allocated), then unlinked: ghost files
    path = f"/dev/shm/ckptd-test-ghost-{os.getpid()}-{i}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, bytes([65 + i]) * (3 << 20))
    os.unlink(path)
    fds.append(fd)
n = 0
while True:
    n += 1
    print(n, flush=True)
    time.sleep(0.02)
"""


def lines(out: Path) -> int:
    return len(out.read_text().splitlines()) if out.exists() else 0


def wait_for_more(out: Path, than: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := lines(out)) <= than:
        assert time.monotonic() < deadline, f"the job printed nothing past line {than}"
        time.sleep(0.02)
    return n


def test_ghosts_each_within_ghost_limit_over_the_dumps_total_are_refused_job_runs_on(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path,
) -> None:
    daemon = start_daemon(config={"ghost_limit": 4 * MiB, "ghost_total_limit": 8 * MiB})
    out = tmp_path / "out"
    pid = start_detached(procs, [VENV_PYTHON, "-c", HOLDER], out)
    seen = wait_for_more(out, 0)
    assert_one_line_error(
        daemon.ctl("dump", pid, "--leave-running"), 2, f"pid {pid}", "3 deleted files",
        "9.0 MiB", "8.0 MiB", "ghost_total_limit", "/dev/shm/ckptd-test-ghost-",
        "daemon's configuration")
    assert_running(pid, "(the job)")
    wait_for_more(out, lines(out))  # it runs on
    assert lines(out) > seen
    assert daemon.checkpoints_of(pid) == []
    # refused at inspect: no CRIU ran, nothing was staged (no work directory of a dump)
    assert list((daemon.state_dir / "work").iterdir()) == []
