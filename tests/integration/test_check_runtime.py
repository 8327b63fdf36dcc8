"""``ckptctl check --json`` reports what this node gives containers (issue 24, 6), as the
node really is — found here independently of the daemon (``stat -f``, this root's CapEff):
the cgroup hierarchy, CAP_SYS_RESOURCE, the OCI runtimes installed, and a one-line warning
with what to do for each thing that keeps a container from starting (on the test machine:
hybrid cgroups with crun installed, and no CAP_SYS_RESOURCE)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .support import Daemon, assert_ok

pytestmark = pytest.mark.integration

CGROUP = Path("/sys/fs/cgroup")


def fs_type(path: Path) -> str:
    done = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def expected_hierarchy() -> str:
    if fs_type(CGROUP) == "cgroup2fs":
        return "unified"
    v1 = [p for p in CGROUP.iterdir()
          if p.is_dir() and p.name not in ("systemd", "unified") and fs_type(p) == "cgroupfs"]
    if not v1:
        return ""
    return "hybrid" if fs_type(CGROUP / "unified") == "cgroup2fs" else "legacy"


def root_has_cap_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff"))
    return bool(int(cap_eff, 16) >> 24 & 1)


def test_check_reports_the_node_s_cgroups_cap_sys_resource_and_runtimes(daemon: Daemon) -> None:
    began = time.monotonic()
    report = assert_ok(daemon.ctl("check"), "check")
    took = time.monotonic() - began

    hierarchy = expected_hierarchy()
    assert report["cgroup_hierarchy"] == hierarchy, report
    cap = root_has_cap_sys_resource()
    assert report["cap_sys_resource"] is cap, report
    for name in ("runc", "crun"):
        if shutil.which(name):
            assert any(p.endswith("/" + name) for p in report["oci_runtimes"]), report

    warnings = report["warnings"]
    assert all("\n" not in w for w in warnings), warnings
    assert any("CAP_SYS_RESOURCE" in w and "--ulimit" in w for w in warnings) is (not cap)
    crun_here = shutil.which("crun") is not None or report["podman_runtime"] == "crun"
    assert any("--runtime runc" in w for w in warnings) is (hierarchy == "hybrid" and crun_here)
    if shutil.which("podman"):
        assert report["podman_runtime"] in ("runc", "crun"), report
    assert took < 10, f"ckptctl check took {took:.1f}s"
