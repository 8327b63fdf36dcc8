"""Issue 34 (3), for real: a job appends to a log that a second process outside its tree also
appends to (two Jupyter kernels' history, a shared log); the job is checkpointed, the other
process writes more, the job is restored. By default that process's lines are still in the
live file (the restore says the file was left as it was, and why), the restored job appends
after them; with ``shared_files = "refuse"`` the restore refuses naming the writer's pid;
``check-restore`` and ``show`` name the file and its writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .support import Daemon, Procs, assert_ok, assert_one_line_error, wait_until

pytestmark = pytest.mark.integration

JOB = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)  # O_WRONLY|O_APPEND, as loggers open theirs
log.write("job 1\\n")
steps = [1]
def step(*_):
    steps[0] += 1
    log.write(f"job {steps[0]}\\n")
signal.signal(signal.SIGUSR1, step)
print("ready", flush=True)
while True:
    time.sleep(1)
"""

OTHER = """
import sys
log = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:  # each line the test sends, appended, then acknowledged
    log.write(line)
    print("wrote", flush=True)
"""


class Other:
    """The writer outside the job's tree: appends each line it is told to, on cue."""

    def __init__(self, procs: Procs, log: Path) -> None:
        self.proc: subprocess.Popen[str] = procs.popen(
            [sys.executable, "-c", OTHER, str(log)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def append(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "wrote\n"


def _checkpointed(daemon: Daemon, procs: Procs, tmp_path: Path) -> tuple[dict[str, Any], Path,
                                                                           Other]:
    """The job and the other writer each append a line; the job is dumped (and so killed);
    then the other writer appends one more."""
    log = tmp_path / "shared.log"
    job = procs.popen([sys.executable, "-c", JOB, str(log)], stdin=subprocess.DEVNULL,
                      stdout=subprocess.PIPE)
    assert job.stdout is not None and job.stdout.readline() == b"ready\n"
    other = Other(procs, log)
    other.append("other 1\n")
    ck = assert_ok(daemon.ctl("dump", job.pid), "dump")
    assert job.wait(timeout=10) != 0
    other.append("other 2\n")
    assert log.read_text() == "job 1\nother 1\nother 2\n"
    return ck, log, other


def test_a_restore_leaves_a_file_another_process_writes_as_it_is_and_says_why(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    ck, log, other = _checkpointed(daemon, procs, tmp_path)
    writer = f"pid {other.pid} ("
    [captured] = [f for f in ck["files"] if f["path"] == str(log)]
    assert any(w.startswith(writer) for w in captured["writers"]), captured

    shown = assert_ok(daemon.ctl("show", ck["id"]), "show")
    [listed] = [f for f in shown["files"] if f["path"] == str(log)]
    assert any(w.startswith(writer) for w in listed["writers"]), listed

    report = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore")
    assert report["compatible"] is True
    [note] = [n for n in report["notes"] if str(log) in n]
    assert writer in note and "leaves it as it is" in note, report

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert str(log) not in res["files_put_back"]
    [left] = res["files_left"]
    assert left.startswith(f"{log} (written by {writer}"), left
    assert log.read_text() == "job 1\nother 1\nother 2\n"  # the other's line is still there
    assert not list(tmp_path.glob("shared.log.ckptd-*"))
    # the restored job appends after it (O_APPEND: CRIU took the file grown)
    os.kill(res["pid"], signal.SIGUSR1)
    wait_until(lambda: log.read_text().endswith("job 2\n"), 10, "the restored job's line")
    assert log.read_text() == "job 1\nother 1\nother 2\njob 2\n"
    other.append("other 3\n")
    assert log.read_text().endswith("job 2\nother 3\n")


def test_with_refuse_the_restore_names_the_writer_and_changes_nothing(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    daemon = start_daemon(config={"shared_files": "refuse"})
    ck, log, other = _checkpointed(daemon, procs, tmp_path)
    check = daemon.ctl("check-restore", ck["id"])
    assert check.rc != 0
    assert any(f"pid {other.pid} (" in b for b in check.out["blocking"]), check.out
    res = daemon.ctl("restore", ck["id"])
    assert res.rc != 0
    assert_one_line_error(res, res.rc, f"written by pid {other.pid}", f"stop pid {other.pid}",
                          "shared_files")
    assert log.read_text() == "job 1\nother 1\nother 2\n"
    assert not list(tmp_path.glob("shared.log.ckptd-*"))
