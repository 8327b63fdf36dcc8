"""Stopping the daemon (SIGTERM) never touches what it restored: restored trees are not its
children, and the relay of a restored terminal job is not tied to it either."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_running,
    descendants,
    reference,
    spawn_shell_job_on_pty,
    wait_for_done,
    wait_for_lines,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 60
INTERVAL = 40


def _stop_and_check_survivor(d: Daemon, pid: int, output: Path, n_before: int) -> None:
    assert pid not in descendants(d.pid), "a restored process must not be the daemon's"
    assert d.stop() == 0, f"ckptd did not exit 0 on SIGTERM:\n{d.log()[-3000:]}"
    assert_running(pid, "(restored, after the daemon stopped)")
    wait_for_lines(output, n_before + 3, timeout=10)  # still making progress
    assert_running(pid, "(restored, after the daemon stopped)")


def test_a_restored_tree_survives_a_daemon_stop(
    start_daemon: Any, procs: Procs, tmp_path: Path
) -> None:
    d: Daemon = start_daemon()
    cmd = workload("tree", "--steps", STEPS, "--children", 2)
    ref = reference(with_interval(cmd, 0))
    proc = procs.popen(
        with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    reader.read_lines(4)
    ck = assert_ok(d.ctl("dump", proc.pid), "dump")
    pre = reader.read_to_eof()
    proc.wait(timeout=10)
    res = assert_ok(d.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    output = Path(res["output_path"])
    lines = wait_for_lines(output, 1)

    _stop_and_check_survivor(d, res["pid"], output, len(lines))
    assert len(descendants(res["pid"])) == 2, "its children survive too"
    assert_continuity(pre, wait_for_done(output, timeout=60), ref)


def test_a_restored_terminal_job_keeps_its_output_after_a_daemon_stop(
    start_daemon: Any, procs: Procs
) -> None:
    d: Daemon = start_daemon()
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    master, pid = spawn_shell_job_on_pty(procs, with_interval(cmd, INTERVAL))
    try:
        reader = LineReader(master)
        reader.read_lines(4)
        ck = assert_ok(d.ctl("dump", pid), "dump")
        pre = reader.read_to_eof()
    finally:
        os.close(master)
    res = assert_ok(d.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    output = Path(res["output_path"])
    lines = wait_for_lines(output, 1)

    _stop_and_check_survivor(d, res["pid"], output, len(lines))
    assert_continuity(pre, wait_for_done(output, timeout=60), ref)
