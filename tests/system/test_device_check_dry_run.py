"""``scripts/device-check.sh OUT --dry-run``: the GPU machine's check script, run here with
CPU jobs and the daemon's fake GPU (``scripts/device_check_daemon.py``), the system CRIU
when the bundle (``.device/criu/criu``) is absent. Every step must pass, the report must list
every check, and the whole run must fit in 90 s (the real run has 6 minutes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ckptd.daemon.config import DEFAULT_CRIU_PATHS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-check.sh"
CHECKS = [
    "setup", "train_stop", "train_leave_running_kill", "fill_raw_cuda", "dataloader_workers",
    "identity_remap", "memory_cgroup_refusal", "daemon_killed_after_lock",
    "daemon_killed_after_checkpoint",
    "figures_1gib", "figures_8gib", "figures_32gib", "infer_second_checkpoint", "tests_gpu",
]


def _criu() -> str | None:
    for cand in (str(ROOT / ".device" / "criu" / "criu"), *DEFAULT_CRIU_PATHS):
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("criu")


def _cgroup2_memory() -> bool:
    from ckptd.adapters.procfs.cgroups import cgroup2_root_with

    return cgroup2_root_with("memory", Path("/proc/self/mountinfo").read_text()) is not None


@pytest.mark.integration
@pytest.mark.slow
def test_device_check_dry_run(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the dry run dumps and restores jobs: needs root")
    criu = _criu()
    if criu is None:
        pytest.skip("no CRIU")
    pytest.importorskip("torch")
    out = tmp_path / "out"
    started = time.monotonic()
    proc = subprocess.run(
        [str(SCRIPT), str(out), "--dry-run", "--criu", criu, "--work", str(tmp_path / "work"),
         "--sizes-gib", "1,8,32"],
        capture_output=True, text=True, timeout=180, check=False, cwd=ROOT,
        env={**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python")},
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert (out / "report.md").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert list(status) == CHECKS
    # the memory-cgroup check needs the memory controller in cgroup v2 (the GPU machine has
    # it; a hybrid host like this VM has memory on v1 only): skipped, saying so, elsewhere
    if not _cgroup2_memory():
        assert status.pop("memory_cgroup_refusal") == "skipped", status
    assert all(s == "pass" for s in status.values()), status
    for check in report["checks"]:
        for name, fig in check["figures"].items():
            assert fig["unit"], f"{check['name']}.{name} has no unit"
    md = (out / "report.md").read_text()
    assert all(f"| {name} | pass |" in md for name in status)
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    assert f"{len(CHECKS)} checks, 0 failed" in last, last  # the table comes last
    # a guard on the suite's length, not a performance figure: ~70 s on an idle 2-core VM,
    # 111 s seen while other test runs shared the 2 cores
    assert took < 150, f"the dry run took {took:.0f}s"
