"""The node-failure case, for real: a leave-running checkpoint, the job writes on (its log, its
state file, its stdout file), dies (kill -9), a launcher writes "Killed" to its stdout file,
and a restore brings it back: its files end byte for byte as an uninterrupted run's, and the
versions found on disk are kept beside them. Without captured content, check-restore
predicts CRIU's "bad size" refusal before anything is touched."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .support import Daemon, Procs, assert_ok, assert_one_line_error, wait_until

pytestmark = pytest.mark.integration

WRITER = Path(__file__).parent / "jobs" / "writer.py"
STEPS = 30
FILES = ("train.log", "state.bin", "out.txt")


def _run(directory: Path, interval_ms: int, procs: Procs) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "out.txt", "wb") as out:  # `> out.txt`: no O_APPEND
        return procs.popen(
            [sys.executable, str(WRITER), str(directory), str(STEPS), str(interval_ms)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _reference(tmp_path: Path, procs: Procs) -> dict[str, bytes]:
    ref = tmp_path / "ref"
    assert _run(ref, 0, procs).wait(timeout=60) == 0
    return {name: (ref / name).read_bytes() for name in FILES}


def _checkpoint_then_crash(
    daemon: Daemon, procs: Procs, job_dir: Path
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A leave-running checkpoint, more steps, kill -9, the launcher's "Killed" line."""
    job = _run(job_dir, 100, procs)
    wait_until(lambda: _lines(job_dir / "out.txt") >= 5, 30, "5 steps before the checkpoint")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    seen = _lines(job_dir / "out.txt")
    wait_until(lambda: _lines(job_dir / "out.txt") >= seen + 4, 30, "steps after it")
    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=10) == -signal.SIGKILL
    with open(job_dir / "out.txt", "ab") as out:
        out.write(b"Killed\n")
    return ck, {name: (job_dir / name).read_bytes() for name in FILES}


def test_restore_after_a_crash_puts_written_files_back_and_the_job_ends_as_uninterrupted(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    want = _reference(tmp_path, procs)
    job_dir = tmp_path / "job"
    ck, at_crash = _checkpoint_then_crash(daemon, procs, job_dir)
    assert sorted(f["path"] for f in ck["files"]) == sorted(str(job_dir / n) for n in FILES)

    report = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore")
    assert report["compatible"] is True
    assert len(report["notes"]) == 3 and all("put back" in n for n in report["notes"])

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert sorted(res["files_put_back"]) == sorted(str(job_dir / n) for n in FILES)
    kept = {Path(k).name.split(".ckptd-")[0]: Path(k).read_bytes() for k in res["files_kept"]}
    assert kept == at_crash  # nothing written after the checkpoint was destroyed
    wait_until(lambda: (job_dir / "out.txt").read_bytes().endswith(b"done\n"), 60,
               "the restored job to finish")
    time.sleep(0.1)
    for name in FILES:
        assert (job_dir / name).read_bytes() == want[name], name


def test_without_captured_content_check_restore_predicts_the_size_refusal(
    start_daemon: Any, procs: Procs, tmp_path: Path
) -> None:
    daemon = start_daemon("--file-capture-limit", "1", "--file-capture-oversize", "skip")
    job_dir = tmp_path / "job"
    ck, at_crash = _checkpoint_then_crash(daemon, procs, job_dir)
    assert ck["files"] == [] and len(ck["files_skipped"]) == 3

    check = daemon.ctl("check-restore", ck["id"])
    assert check.rc != 0
    report = check.out
    # CRIU's own rule: the exact size of a file written without O_APPEND (stdout opened
    # with `>`, the state file); a log opened with O_APPEND may have grown
    # The state file cycles through 7 sizes: when the crash falls a multiple of 7 steps after
    # the checkpoint (seen once on a loaded machine) it has its checkpointed size again and
    # CRIU takes it; what the dump recorded of it decides.
    state = str(job_dir / "state.bin")
    recorded = next(int(m.group(1)) for s in ck["files_skipped"]
                    if s.startswith(state + " ") and (m := re.search(r"\((\d+) B > ", s)))
    want = [str(job_dir / "out.txt")] + ([state] if len(at_crash["state.bin"]) != recorded
                                         else [])
    blocked = sorted(b.split()[1] for b in report["blocking"])
    assert blocked == sorted(want), report
    assert all("needs exactly" in b for b in report["blocking"]), report
    res = daemon.ctl("restore", ck["id"])
    assert_one_line_error(res, res.rc, "does not fit this node", "needs exactly")
    for name in FILES:  # refused before anything was touched
        assert (job_dir / name).read_bytes() == at_crash[name], name


def test_ckptctl_asides_lists_the_copies_kept_and_removes_them(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """Issue 24 (5): the copies restores keep aside can be listed and removed."""
    job_dir = tmp_path / "job"
    ck, _ = _checkpoint_then_crash(daemon, procs, job_dir)
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: (job_dir / "out.txt").read_bytes().endswith(b"done\n"), 60,
               "the restored job to finish")
    listed = assert_ok(daemon.ctl("asides", ck["id"]), "asides")
    assert sorted(a["path"] for a in listed["asides"]) == sorted(res["files_kept"])
    assert listed["removed"] == [] and all(Path(k).exists() for k in res["files_kept"])
    everyone = assert_ok(daemon.ctl("asides"), "asides (every checkpoint's files)")
    assert set(res["files_kept"]) <= {a["path"] for a in everyone["asides"]}
    removed = assert_ok(daemon.ctl("asides", ck["id"], "--remove"), "asides --remove")
    assert sorted(removed["removed"]) == sorted(res["files_kept"])
    assert not any(Path(k).exists() for k in res["files_kept"])
    assert sorted(p.name for p in job_dir.iterdir()) == sorted(FILES)
