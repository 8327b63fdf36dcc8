"""deploy/: the Kubernetes manifests parse and say what they must; the shell scripts parse."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _docs(name: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    text = (DEPLOY / "kubernetes" / name).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def test_daemonset() -> None:
    docs = {d["kind"]: d for d in _docs("ckptd-daemonset.yaml")}
    assert set(docs) == {"Namespace", "DaemonSet"}
    ds = docs["DaemonSet"]
    assert ds["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"] == "ckptd-system"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["privileged"] is True
    # the host's cgroup namespace and hierarchy: restored jobs go into their callers' pods'
    # cgroups (or /ckptd-jobs), never this pod's (docs/adr/0010)
    assert container["command"] == [
        "nsenter", "--cgroup=/proc/1/ns/cgroup", "--",
        "ckptd", "--socket", "/run/ckptd/ckptd.sock", "--store", "/var/lib/ckptd",
        "--cgroup-fs", "/host/sys/fs/cgroup",
    ]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert {"/var/lib/ckptd", "/run/ckptd", "/dev/shm"} <= set(host_paths.values())
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert (host_paths["cgroup"], mounts["cgroup"]) == ("/sys/fs/cgroup", "/host/sys/fs/cgroup")
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert "ckptctl" in container["livenessProbe"]["exec"]["command"]


def test_training_job() -> None:
    (job,) = _docs("training-job.yaml")
    assert job["kind"] == "Job"
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"][:4] == ["ckptctl", "run", "--name", "$(JOB_NAME)"]
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "dump --name" in pre_stop and "/run/ckptd/ckptd.sock" in pre_stop
    assert spec["terminationGracePeriodSeconds"] >= 120
    assert any(v.get("hostPath", {}).get("path") == "/run/ckptd" for v in spec["volumes"])


@pytest.mark.parametrize(
    "script", ["slurm/train.sbatch", "slurm/prolog.sh", "slurm/epilog.sh"]
)
def test_shell_scripts_parse(script: str) -> None:
    proc = subprocess.run(
        ["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_sbatch_directives() -> None:
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@120" in text
    assert "#SBATCH --requeue" in text
    assert 'NAME="$SLURM_JOB_NAME-$SLURM_JOB_ID"' in text
    assert "ckptctl restore --name" in text
