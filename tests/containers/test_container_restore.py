"""A job checkpointed in container A and restored into container B (issue #12, points 1-2),
with real runc/crun/podman and CRIU run inside the containers (raw CRIU driven by
``ckptd.adapters.criu.containers``; the daemon does not do this yet: see
test_ckptctl_run_in_containers.py). Each flow is a short job (~2 s) and a few container starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.adapters.criu.containers import ContainerError

from .bundle import CHECKOUT, ContainerSpec, build_rootfs, venv_dir
from .flow import Flow, FlowError, criu_binary
from .runtime import OciContainer, RuntimeError_

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def assert_moved(seen: dict[str, object], flow: Flow) -> None:
    """Everything the flow promises: B's namespaces, cgroups and root; B's init the parent;
    B's exit status the job's; output and files bit for bit."""
    restored = seen["restored"]
    assert isinstance(restored, dict), seen
    assert restored["namespaces_equal"] == dict.fromkeys(
        ("pid", "net", "ipc", "uts", "cgroup", "mnt"), True), seen
    assert restored["cgroup_equal"], seen
    assert restored["root_equal"], seen
    assert restored["ppid_is_b_init"], seen
    assert restored["ns_pid"] == seen["a_job_ns_pid"], seen
    assert restored["seccomp"] == seen["a_seccomp"], seen  # podman's default filter: 2
    assert seen["a_status_after_dump"] in ("stopped", "absent", "exited"), seen
    assert seen["b_exit_status"] == flow.exit_status, seen
    assert seen["stdout_equal"], seen
    assert seen["log_equal"] and seen["state_equal"], seen


def test_rootfs_builds_in_milliseconds_then_is_reused(tmp_path: Path) -> None:
    took = build_rootfs(tmp_path / "rootfs")
    assert 0 < took < 1.0
    assert build_rootfs(tmp_path / "rootfs") == 0.0
    assert (tmp_path / "rootfs" / "usr").is_dir()
    assert os.readlink(tmp_path / "rootfs" / "bin") == "usr/bin"


def test_a_container_runs_python_ckptctl_and_criu_in_its_own_namespaces(
    rootfs: Path, tmp_path: Path
) -> None:
    probe = ("import json, os, socket, subprocess, grpc, ckptd; print(json.dumps({"
             "'pid': os.getpid(), 'host': socket.gethostname(), "
             "'ns': {k: os.stat(f'/proc/self/ns/{k}').st_ino for k in "
             "('pid', 'mnt', 'net', 'ipc', 'uts', 'cgroup')}, "
             "'ctl': subprocess.run(['ckptctl', '--help'], capture_output=True).returncode, "
             f"'criu': subprocess.run([{criu_binary()!r}, '--version'], "
             "capture_output=True, text=True).stdout.split()[1]}))")
    c = OciContainer("ckptd-probe-" + str(os.getpid()), tmp_path / "probe",
                     ContainerSpec(rootfs=rootfs, args=["python3", "-c", probe],
                                   hostname="probe",
                                   cgroups_path=f"/ckptd-test/probe-{os.getpid()}"))
    try:
        c.run()
        assert c.wait(timeout=60) == 0, c.err.read_text()
    finally:
        c.delete()
    seen = json.loads(c.out.read_text())
    assert seen["pid"] == 1 and seen["host"] == "probe"
    assert seen["ctl"] == 0
    assert seen["criu"].startswith("4.")
    mine = {k: os.stat(f"/proc/self/ns/{k}").st_ino for k in seen["ns"]}
    assert all(seen["ns"][k] != mine[k] for k in mine), (seen, mine)
    assert str(venv_dir()) in os.environ.get("VIRTUAL_ENV", str(venv_dir()))
    assert (CHECKOUT / "ckptd").is_dir()


@pytest.mark.parametrize("preload", [True, False], ids=["criu-from-node", "criu-in-image"])
def test_job_checkpointed_in_a_continues_in_b(
    make_flow: Callable[..., Flow], preload: bool
) -> None:
    """criu-from-node: the containers' root has no CRIU (/usr/local/sbin hidden): CRIU is
    loaded from the node, then moved into the mount namespace (native/enter-mntns)."""
    flow = make_flow(preload=preload)
    assert_moved(flow.run(), flow)
    assert flow.timings["dump_s"] < 5 and flow.timings["restore_s"] < 5


def test_tcp_connections_inside_the_container_move_with_it(
    make_flow: Callable[..., Flow]
) -> None:
    flow = make_flow(job="tcp")
    assert_moved(flow.run(), flow)


def test_podman_rootfs_containers(make_flow: Callable[..., Flow]) -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman; scripts/test.sh does)")
    flow = make_flow(engine="podman")
    assert_moved(flow.run(), flow)


def test_crun_containers(make_flow: Callable[..., Flow], monkeypatch: pytest.MonkeyPatch
                         ) -> None:
    if shutil.which("crun") is None:
        pytest.skip("crun is not installed (apt-get install crun; scripts/test.sh does)")
    monkeypatch.setenv("CKPTD_TEST_RUNTIME", "crun")
    flow = make_flow()
    try:
        seen = flow.run()
    except RuntimeError_ as exc:
        if "hybrid mode not supported" in str(exc):
            pytest.skip("crun 1.8 refuses this machine's hybrid cgroups (v1 controllers with "
                        f"a controller on the v2 hierarchy): {exc}")
        raise
    assert_moved(seen, flow)


def test_a_checkpoint_whose_pids_are_taken_in_b_is_refused_before_criu_runs(
    make_flow: Callable[..., Flow]
) -> None:
    """Without the pid base, the job's pids in A are low, and B's init holds low pids too
    (decoys, as ckptctl run's threads would): refused, naming the pid, B untouched; CRIU
    itself (the check skipped) fails with `Can't fork for N: File exists`."""
    flow = make_flow(pid_base=0, decoys=40)
    flow.prepare()
    a = flow.start_a()
    b: OciContainer | None = None
    try:
        flow.checkpoint(a)
        flow.remove(a)
        job_pid = flow.facts["a_job_ns_pid"]
        assert isinstance(job_pid, int) and job_pid < 30, flow.facts
        images = sorted(p.name for p in flow.images.iterdir())
        b = flow.start_b()
        # the job is a tree (sh, its child): whichever of its low pids B holds is named
        with pytest.raises(ContainerError, match=r"pid (\d+) of the checkpoint is taken") as info:
            flow.restore_into(b)
        taken = int(info.value.args[0].split()[1])
        assert job_pid <= taken < job_pid + 5, (taken, job_pid)
        assert b.status() == "running"
        assert sorted(p.name for p in flow.images.iterdir()) == images
        with pytest.raises(FlowError, match=r"Can't fork for \d+: File exists"):
            flow.restore_into(b, check_pids=False)
        assert b.status() == "running"
    finally:
        a.delete()
        if b is not None:
            b.delete()


def test_the_restored_job_dies_with_its_container(make_flow: Callable[..., Flow]) -> None:
    """The restored tree is in B's cgroups: removing B (what the kubelet does) ends it."""
    flow = make_flow(steps=400)
    flow.prepare()
    a = flow.start_a()
    b: OciContainer | None = None
    try:
        flow.checkpoint(a)
        flow.remove(a)
        b = flow.start_b()
        _, root = flow.restore_into(b)
        assert Path(f"/proc/{root}").exists()
        b.delete()
        subprocess.run(["sleep", "0.3"], check=True)
        assert not Path(f"/proc/{root}").exists() or "Z" in _state(root)
    finally:
        a.delete()
        if b is not None:
            b.delete()


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]
