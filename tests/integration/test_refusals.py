"""Bad requests and failed dumps: one clear line on stderr, a non-zero exit, nothing changed.

"Nothing changed" means: no checkpoint listed for the pid, and the target (when there is one)
still running, not stopped (/proc/PID/stat state not T or t), its output going on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import (
    CtlResult,
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_one_line_error,
    assert_running,
    assert_same_lines,
    descendants,
    free_pid,
    proc_state,
    reference,
    stat_fields,
    wait_for_done,
    wait_state,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

EXIT_FAILURE, EXIT_USAGE, EXIT_BUSY = 1, 2, 4
STEPS = 40
INTERVAL = 30
UNKNOWN_ID = "ck-20000101T000000-abcdef"


class Job:
    """A counter with stdout on a pipe the test reads."""

    def __init__(self, procs: Procs, *args: object, steps: int = STEPS) -> None:
        self.cmd = workload("counter", "--steps", steps, *args)
        self.proc = procs.popen(
            with_interval(self.cmd, INTERVAL), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid
        self.reader.read_lines(3)

    def assert_untouched(self, daemon: Daemon) -> None:
        """Running, not stopped, printing on, and nothing listed for it."""
        assert_running(self.pid)
        before = len(self.reader.drain())
        self.reader.read_lines(before + 2, timeout=5)
        assert_running(self.pid)
        assert daemon.checkpoints_of(self.pid) == []


def assert_nothing_listed(daemon: Daemon, pid: int) -> None:
    assert daemon.checkpoints_of(pid) == []


# ---- dump: targets that must be refused ------------------------------------------------------


def test_dump_of_a_nonexistent_pid(daemon: Daemon) -> None:
    pid = free_pid()
    res = daemon.ctl("dump", pid)
    assert_one_line_error(res, EXIT_USAGE, f"no process with pid {pid}")
    assert_nothing_listed(daemon, pid)


@pytest.fixture
def refused_target(request: pytest.FixtureRequest, daemon: Daemon) -> tuple[int, str]:
    kind = request.param
    if kind == "init":
        return 1, "pid 1"
    if kind == "daemon":
        return daemon.pid, "daemon"
    if kind == "ancestor":  # the test process started the daemon: it is its parent
        assert daemon.proc.pid in [int(c) for c in Path(
            f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()]
        return os.getpid(), "ancestor"
    assert kind == "kthread"
    try:
        comm = Path("/proc/2/comm").read_text().strip()
    except FileNotFoundError:
        comm = "nothing"  # in a pid namespace of its own, as in a container
    if comm != "kthreadd":
        pytest.skip(f"pid 2 is {comm!r}, not kthreadd, on this machine")
    return 2, "kernel thread"


@pytest.mark.parametrize(
    "refused_target", ["init", "daemon", "ancestor", "kthread"], indirect=True
)
def test_dump_of_a_protected_process_is_refused(
    daemon: Daemon, refused_target: tuple[int, str]
) -> None:
    pid, needle = refused_target
    state = proc_state(pid)
    res = daemon.ctl("dump", pid)
    assert_one_line_error(res, EXIT_USAGE, f"pid {pid}", needle)
    assert proc_state(pid) not in ("T", "t"), "the target must not be left stopped"
    assert proc_state(pid) is not None and state is not None
    assert_nothing_listed(daemon, pid)
    assert daemon.proc.poll() is None, "the daemon must still run"


def test_dump_of_a_zombie_is_refused(daemon: Daemon, procs: Procs) -> None:
    child = procs.popen(["sleep", "60"])
    child.kill()
    wait_state(child.pid, ["Z"])
    try:
        res = daemon.ctl("dump", child.pid)
        assert_one_line_error(res, EXIT_USAGE, f"pid {child.pid}", "zombie", str(os.getpid()))
        assert proc_state(child.pid) == "Z"
        assert_nothing_listed(daemon, child.pid)
    finally:
        child.wait(timeout=10)


# ---- one operation per pid at a time -----------------------------------------------------------


def _criu_running(daemon: Daemon) -> bool:
    """Whether the daemon has a CRIU at work (a dump in progress)."""
    return any(
        (stat_fields(pid) or ["", ""])[1] == "criu" for pid in descendants(daemon.pid)
    )


def test_a_second_dump_of_a_pid_being_dumped_is_busy(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    big = procs.popen(
        workload("bigmem", "--mib", 1024, "--steps", 0, "--interval-ms", 200,
                 "--ready-file", ready),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until(ready.exists, 60, "bigmem to fill its memory")
    assert not _criu_running(daemon)

    first = daemon.popen("dump", big.pid, "--leave-running")
    wait_until(lambda: _criu_running(daemon) or first.poll() is not None, 30,
               "the first dump to start CRIU")
    assert first.poll() is None, "the first dump ended before the second could start"
    second = daemon.popen("dump", big.pid, "--leave-running")
    out2, err2 = second.communicate(timeout=60)
    still_dumping = first.poll() is None
    out1, err1 = first.communicate(timeout=120)
    assert still_dumping, "the first dump had ended before the second was answered"

    assert first.returncode == 0, err1
    # the second is refused at once, while the first still holds the pid
    assert_one_line_error(
        CtlResult(second.returncode, out2, err2), EXIT_BUSY, "busy", f"pid {big.pid}"
    )
    assert_running(big.pid, "after the dumps")
    listed = daemon.checkpoints_of(big.pid)
    assert len(listed) == 1, "only the first dump made a checkpoint"
    assert listed[0]["id"] in out1
    assert_ok(daemon.ctl("delete", listed[0]["id"]), "delete")
    assert daemon.checkpoints_of(big.pid) == []


# ---- unknown checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["restore", "show", "delete"])
@pytest.mark.parametrize("checkpoint_id", [UNKNOWN_ID, "no-such-checkpoint"])
def test_unknown_checkpoint_id(daemon: Daemon, command: str, checkpoint_id: str) -> None:
    before = assert_ok(daemon.ctl("list"), "list")
    res = daemon.ctl(command, checkpoint_id)
    assert_one_line_error(res, EXIT_USAGE, checkpoint_id)
    assert assert_ok(daemon.ctl("list"), "list") == before


# ---- restore: pids that are taken --------------------------------------------------------------


def test_restore_while_the_original_still_runs_names_the_pid(
    daemon: Daemon, procs: Procs
) -> None:
    job = Job(procs)
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    res = daemon.ctl("restore", ck["id"])
    line = assert_one_line_error(res, EXIT_USAGE, f"pid {job.pid}", "in use")
    assert ck["id"] in line
    assert_running(job.pid, "(the original)")
    before = len(job.reader.drain())
    job.reader.read_lines(before + 2, timeout=5)
    assert [c["id"] for c in daemon.checkpoints_of(job.pid)] == [ck["id"]]


def test_restore_waits_for_an_unreaped_zombie_then_names_it_and_its_parent(
    daemon: Daemon, procs: Procs
) -> None:
    job = Job(procs)
    ref = reference(with_interval(job.cmd, 0))
    ck = assert_ok(daemon.ctl("dump", job.pid), "dump")
    pre = job.reader.read_to_eof()
    wait_state(job.pid, ["Z"])  # killed; we are its parent and do not reap it yet

    started = time.monotonic()
    res = daemon.ctl("restore", ck["id"])
    waited = time.monotonic() - started
    line = assert_one_line_error(res, EXIT_USAGE, "zombie")
    assert f"pid {job.pid}" in line, line
    assert f"parent pid {os.getpid()}" in line, line
    assert waited >= 4.5, f"the daemon gave up after {waited:.1f}s, not ~5s"
    assert proc_state(job.pid) == "Z"

    assert job.proc.wait(timeout=10) == -signal.SIGKILL  # reap it: now the restore works
    res2 = assert_ok(daemon.ctl("restore", ck["id"]), "restore after reaping")
    procs.add(res2["pid"])
    post = wait_for_done(Path(res2["output_path"]))
    assert_continuity(pre, post, ref)


# ---- CRIU missing -------------------------------------------------------------------------------


def test_a_daemon_without_criu_reports_it_and_refuses_dumps(
    start_daemon: Any, procs: Procs
) -> None:
    missing = "/nonexistent/criu"
    d: Daemon = start_daemon("--criu", missing)
    report = assert_ok(d.ctl("check"), "check")
    assert report["criu_ok"] is False
    assert missing in report["criu_message"], report["criu_message"]

    job = Job(procs)
    res = d.ctl("dump", job.pid)
    assert_one_line_error(res, EXIT_USAGE, missing)
    job.assert_untouched(d)


# ---- a dump that CRIU fails ---------------------------------------------------------------------


@pytest.fixture
def socketpair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def test_a_failed_dump_leaves_the_target_running_and_nothing_listed(
    daemon: Daemon, procs: Procs, socketpair: tuple[socket.socket, socket.socket]
) -> None:
    """stdout on a unix socket whose other end the test holds: CRIU refuses to dump an
    external unix socket (no ext_unix_sk), after it has seized the tree."""
    ours, theirs = socketpair
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    proc = procs.popen(
        with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=theirs.fileno(),
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    reader = LineReader(ours.fileno())
    reader.read_lines(3)

    res = daemon.ctl("dump", proc.pid)
    line = assert_one_line_error(res, EXIT_FAILURE, "criu", "unix")
    assert "(criu: " in line, f"CRIU's own reason is missing: {line}"
    assert_running(proc.pid, "after a failed dump")
    assert daemon.checkpoints_of(proc.pid) == []

    lines = reader.read_to_eof(timeout=30)
    assert proc.wait(timeout=10) == 0
    assert_same_lines(lines, ref, "output of the job whose dump failed")
