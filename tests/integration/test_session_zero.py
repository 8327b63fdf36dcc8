"""A job whose session leader is outside its pid namespace (getsid() == 0: started under an
init that never called setsid, as on CI machines and in some containers) cannot be dumped by
CRIU. ckptd says so before touching it, with the way out, and leaves it running; the same job
started with setsid is checkpointed, by a daemon that itself runs in that pid namespace.

The scenario runs as pid 1 of a pid namespace the test creates (pidns_scenario.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import criu_path
from .support import CKPTCTL, CKPTD, REPO

pytestmark = pytest.mark.integration

SCENARIO = Path(__file__).with_name("pidns_scenario.py")


def test_a_job_in_session_zero_is_refused_clearly_and_keeps_running(
    workloads: Path, tmp_path: Path
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    run = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, str(SCENARIO),
         str(tmp_path), str(CKPTD), str(CKPTCTL), str(workloads / "counter"),
         "--criu", str(criu_path())],
        capture_output=True, text=True, timeout=180, cwd=REPO, check=False,
    )
    log = tmp_path / "ckptd.log"
    detail = f"stderr: {run.stderr}\nckptd log:\n{log.read_text() if log.exists() else ''}"
    assert run.returncode == 0, detail
    report = json.loads(run.stdout)
    assert report["own_session"] == 0, "the scenario must run in session 0"

    zero = report["zero"]
    assert zero["session"] == 0
    assert zero["rc"] == 2 and zero["stdout"] == "", detail
    lines = zero["stderr"].splitlines()
    assert len(lines) == 1, zero["stderr"]
    assert "is in session 0" in lines[0] and "setsid" in lines[0], lines[0]
    assert zero["state"] not in ("T", "t"), "a refused job must be left running"

    own = report["own"]
    assert own["session"] != 0
    assert own["rc"] == 0, f"{own['stderr']}\n{detail}"
    assert json.loads(own["stdout"])["leave_running"] is True
    assert own["state"] not in ("T", "t")
    assert report["daemon_alive"], detail
