"""Output directories rolled back too (``--files DIR``, issue 34, point 5), for real: a job
that opens, appends to and closes its metrics file every step (as MLflow's file store does)
holds no descriptor of it at a checkpoint, so nothing puts it back after a crash and the steps
between the checkpoint and the crash are logged twice. With ``--files DIR`` every regular
file under DIR is captured by content with each checkpoint and put back by the restore: the
directory ends byte for byte as an uninterrupted run's. Through ``ckptctl dump`` and
through ``ckptctl run --every`` (a policy) followed by ``ckptctl resume`` after a SIGKILL; the
three forms docs/guides/files.md shows (run, dump, policy set)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support import CKPTCTL, Daemon, Procs, assert_ok, wait_until

pytestmark = pytest.mark.integration

APPENDER = Path(__file__).parent / "jobs" / "appender.py"
STEPS = 40


def _run(directory: Path, interval_ms: int, procs: Procs) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    return procs.popen([sys.executable, str(APPENDER), str(directory), str(STEPS),
                        str(interval_ms)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _contents(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, the copies a restore kept aside
    left out."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file() and ".ckptd-" not in p.name}


def _steps(directory: Path) -> int:
    metrics = directory / "metrics.csv"
    return metrics.read_bytes().count(b"\n") if metrics.exists() else 0


@pytest.fixture
def reference(tmp_path: Path, procs: Procs) -> dict[str, bytes]:
    ref = tmp_path / "ref"
    assert _run(ref, 0, procs).wait(timeout=60) == 0
    return _contents(ref)


def _dump_write_on_and_crash(daemon: Daemon, procs: Procs, out: Path,
                             *dump_args: str) -> Any:
    job = _run(out, 100, procs)
    wait_until(lambda: _steps(out) >= 7, 30, "7 steps before the checkpoint")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running", *dump_args), "dump")
    seen = _steps(out)
    wait_until(lambda: _steps(out) >= seen + 6, 30, "6 steps after it")
    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=10) == -signal.SIGKILL
    return ck


def _restore_and_finish(daemon: Daemon, procs: Procs, checkpoint_id: str, out: Path) -> Any:
    res = assert_ok(daemon.ctl("restore", checkpoint_id), "restore")
    procs.add(res["pid"])
    wait_until((out / "done").exists, 60, "the restored job to finish")
    return res


def test_files_dir_puts_an_open_append_close_log_back_and_the_job_ends_as_uninterrupted(
    daemon: Daemon, procs: Procs, tmp_path: Path, reference: dict[str, bytes]
) -> None:
    out = tmp_path / "job"
    ck = _dump_write_on_and_crash(daemon, procs, out, "--files", str(out))
    captured = {f["path"] for f in ck["files"]}
    assert str(out / "metrics.csv") in captured and str(out / "summary.json") in captured
    assert any(p.startswith(str(out / "saved") + "/") for p in captured)
    at_crash = _contents(out)

    res = _restore_and_finish(daemon, procs, ck["id"], out)
    assert str(out / "metrics.csv") in res["files_put_back"]
    assert _contents(out) == reference  # no step logged twice, every file as uninterrupted
    kept = {Path(k).name.split(".ckptd-")[0]: Path(k).read_bytes() for k in res["files_kept"]}
    assert kept["metrics.csv"] == at_crash["metrics.csv"]  # what the crash left is kept aside


def test_without_files_dir_the_steps_after_the_checkpoint_are_logged_twice(
    daemon: Daemon, procs: Procs, tmp_path: Path, reference: dict[str, bytes]
) -> None:
    """The limit ``--files`` lifts, as the files guide states it: nothing holds the log open
    at the checkpoint, so the restore leaves it as the crash left it."""
    out = tmp_path / "job"
    ck = _dump_write_on_and_crash(daemon, procs, out)
    assert not any(f["path"].startswith(str(out)) for f in ck["files"])
    _restore_and_finish(daemon, procs, ck["id"], out)
    assert _steps(out) > STEPS  # the steps between checkpoint and crash, twice
    assert (out / "metrics.csv").read_bytes() != reference["metrics.csv"]


def test_run_files_every_then_sigkill_and_resume_ends_as_uninterrupted(
    daemon: Daemon, procs: Procs, tmp_path: Path, reference: dict[str, bytes]
) -> None:
    out = tmp_path / "job"
    out.mkdir()
    launcher = procs.popen(
        [str(CKPTCTL), "--socket", str(daemon.socket), "run", "--name", "appender",
         "--every", "10s", "--files", str(out), "--", sys.executable, str(APPENDER),
         str(out), str(STEPS), "400"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    wait_until(lambda: launcher.poll() is not None or children.read_text().split(), 10,
               "ckptctl run to start the job")
    assert launcher.poll() is None, launcher.communicate()
    job = int(children.read_text().split()[0])

    def policy() -> dict[str, Any]:
        shown = assert_ok(daemon.ctl("policy", "show"), "policy show")
        return next(p for p in shown if p["name"] == "appender")

    assert policy()["files_dirs"] == [str(out)]
    wait_until(lambda: policy()["last_checkpoint_id"], 30, "a periodic checkpoint")
    seen = _steps(out)
    wait_until(lambda: _steps(out) >= seen + 3, 30, "steps after it")
    os.kill(job, signal.SIGKILL)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode != 0 and b"ckptctl resume appender" in err, err

    res = assert_ok(daemon.ctl("resume", "appender"), "resume")
    procs.add(res["restored"][0]["pid"])
    wait_until((out / "done").exists, 60, "the resumed job to finish")
    assert _contents(out) == reference
    other = tmp_path / "other"
    set_res = assert_ok(daemon.ctl("policy", "set", "appender", "--files", str(other)),
                        "policy set --files")
    assert set_res["files_dirs"] == [str(other)]
