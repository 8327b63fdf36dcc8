"""deploy/: every Kubernetes manifest is valid against the Kubernetes API's own schemas (every
minor version from 1.30 on that ``kubernetes-validate`` ships: its JSON schemas are generated
from the API's OpenAPI documents; offline) and says what it must; the shell scripts parse."""

from __future__ import annotations

import copy
import importlib
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(p.name for p in (DEPLOY / "kubernetes").glob("*.yaml"))
OLDEST = (1, 30)
"""The oldest Kubernetes the manifests must be valid for (every newer one shipped is checked)."""
SETUP = "it is in the dev extra: bash scripts/setup.sh installs it"


def _module(name: str, package: str) -> ModuleType:
    """Imported, or the test fails saying why: a missing checker must not pass vacuously."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{package} is not installed ({exc}); {SETUP}")


def _load(text: str) -> list[dict[str, Any]]:
    yaml = _module("yaml", "PyYAML")
    return [d for d in yaml.safe_load_all(text) if d]


def _docs(name: str) -> list[dict[str, Any]]:
    return _load((DEPLOY / "kubernetes" / name).read_text())


def kube_versions() -> list[str]:
    """Every minor version >= OLDEST whose schemas kubernetes-validate ships, oldest first."""
    utils = _module("kubernetes_validate.utils", "kubernetes-validate")
    shipped = {tuple(int(n) for n in v.split(".")[:2]) for v in utils.all_versions()}
    wanted = sorted(v for v in shipped if v >= OLDEST)
    assert wanted and wanted[0] == OLDEST, f"kubernetes-validate ships {sorted(shipped)}"
    return [f"{major}.{minor}" for major, minor in wanted]


def schema_errors(doc: dict[str, Any], version: str) -> list[str]:
    """Why the API of Kubernetes ``version`` would reject ``doc`` by its schema (unknown kind
    or apiVersion, unknown field: strict schemas, wrong type, missing required field); [] when
    it is valid."""
    kv = _module("kubernetes_validate", "kubernetes-validate")
    what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} on Kubernetes {version}"
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(part) for part in exc.path) or "(top)"
        return [f"{what}: {path}: {exc.message}"]
    except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as exc:
        return [f"{what}: {exc.message}"]
    return []


ENV_FIELD_PATHS = re.compile(
    r"metadata\.(name|namespace|uid)|metadata\.(labels|annotations)\['[^']+'\]"
    r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs)"
)
"""The pod fields an environment variable may take (fieldRef); whole label/annotation maps
are for downwardAPI volumes only."""


def api_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server checks beyond the schema, for the kinds of deploy/: names, the
    selector of a DaemonSet, a Job's restart policy and pod failure policy, volumes, hostPath
    types, $(VAR)s (and where the kubelet does not expand them), env fieldRefs."""
    problems: list[str] = []
    dns_label = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
    meta = doc.get("metadata") or {}
    if not dns_label.fullmatch(str(meta.get("name", ""))):
        problems.append(f"metadata.name {meta.get('name')!r} is not a DNS-1123 label")
    spec = doc.get("spec") or {}
    template = spec.get("template") or {}
    if doc.get("kind") == "DaemonSet":
        wanted = (spec.get("selector") or {}).get("matchLabels") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        if not wanted or any(labels.get(k) != v for k, v in wanted.items()):
            problems.append("spec.selector.matchLabels do not select spec.template's labels")
    pod = template.get("spec") or {}
    if doc.get("kind") == "Job" and pod.get("restartPolicy") not in ("OnFailure", "Never"):
        problems.append("a Job's pods need restartPolicy OnFailure or Never")
    failure_policy = spec.get("podFailurePolicy") if doc.get("kind") == "Job" else None
    if failure_policy is not None:
        if pod.get("restartPolicy") != "Never":
            problems.append("spec.podFailurePolicy needs restartPolicy Never")
        if spec.get("podReplacementPolicy", "Failed") != "Failed":
            problems.append("spec.podReplacementPolicy must be Failed with a podFailurePolicy")
        containers = {c.get("name") for c in pod.get("containers") or []}
        for rule in failure_policy.get("rules") or []:
            codes = rule.get("onExitCodes")
            if (codes is None) == (rule.get("onPodConditions") is None):
                problems.append("a podFailurePolicy rule needs onExitCodes or onPodConditions")
            if codes and codes.get("containerName") not in (None, *containers):
                problems.append(f"podFailurePolicy: no container {codes.get('containerName')!r}")
            if codes and codes.get("operator") == "In" and 0 in (codes.get("values") or []):
                problems.append("podFailurePolicy: exit code 0 cannot be In")
    volumes = {v.get("name") for v in pod.get("volumes") or []}
    host_path_types = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                       "CharDevice", "BlockDevice"}
    for v in pod.get("volumes") or []:
        kind = (v.get("hostPath") or {}).get("type")
        if kind is not None and kind not in host_path_types:
            problems.append(f"volume {v.get('name')}: hostPath.type {kind!r} is not a type")
    names = [c.get("name") for c in pod.get("containers") or []]
    if len(set(names)) != len(names):
        problems.append(f"container names repeat: {names}")
    for c in pod.get("containers") or []:
        if not dns_label.fullmatch(str(c.get("name", ""))):
            problems.append(f"container name {c.get('name')!r} is not a DNS-1123 label")
        for mount in c.get("volumeMounts") or []:
            if mount.get("name") not in volumes:
                problems.append(f"container {c.get('name')}: no volume {mount.get('name')!r}")
        env = {e.get("name") for e in c.get("env") or []}
        for arg in [*(c.get("command") or []), *(c.get("args") or [])]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(arg)):
                if var not in env:
                    problems.append(f"container {c.get('name')}: $({var}) is not in its env")
        for e in c.get("env") or []:
            path = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if path is not None and not ENV_FIELD_PATHS.fullmatch(str(path)):
                problems.append(f"container {c.get('name')}: env {e.get('name')}: fieldPath "
                                f"{path!r} is not available to environment variables")
        for hook, handler in (c.get("lifecycle") or {}).items():
            for arg in (handler.get("exec") or {}).get("command") or []:
                if re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", str(arg)):
                    problems.append(f"container {c.get('name')}: {hook}: the kubelet does not "
                                    f"expand $(VAR) in lifecycle hooks: {arg!r}")
    return problems


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_valid_for_every_kubernetes_from_1_30(name: str) -> None:
    docs = _docs(name)
    assert docs, f"{name} holds no document"
    versions = kube_versions()
    problems = [p for doc in docs for v in versions for p in schema_errors(doc, v)]
    problems += [f"{doc.get('kind')}: {p}" for doc in docs for p in api_errors(doc)]
    assert problems == [], "\n".join(problems)


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = doc["spec"]["template"]["spec"]
    return pod


BREAKAGES: dict[str, tuple[str, Callable[[dict[str, Any]], object], str]] = {
    # name: (manifest, how the copy is broken, what the error must name)
    "misspelled field": (
        "ckptd-daemonset.yaml", lambda d: _pod(d).update(hostPid=_pod(d).pop("hostPID")),
        "'hostPid' was unexpected",
    ),
    "wrong type": (
        "ckptd-daemonset.yaml",
        lambda d: _pod(d).update(terminationGracePeriodSeconds="150"),
        "terminationGracePeriodSeconds: '150' is not of type 'integer'",
    ),
    "removed apiVersion": (
        "ckptd-daemonset.yaml", lambda d: d.update(apiVersion="extensions/v1beta1"),
        "Couldn't find schema for kind DaemonSet with api version extensions/v1beta1",
    ),
    "unknown kind": (
        "training-job.yaml", lambda d: d.update(kind="Jobs"),
        "Couldn't find schema for kind Jobs",
    ),
    "missing required field": (
        "training-job.yaml", lambda d: _pod(d)["containers"][0].pop("name"),
        "containers.0: 'name' is a required property",
    ),
    "string for a list": (
        "training-job.yaml",
        lambda d: _pod(d)["containers"][0]["lifecycle"]["preStop"]["exec"].update(
            command="ckptctl dump --name train-llm"
        ),
        "preStop.exec.command: 'ckptctl dump --name train-llm' is not of type 'array'",
    ),
    "selector not matching": (
        "ckptd-daemonset.yaml",
        lambda d: d["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": "x"}),
        "spec.selector.matchLabels do not select spec.template's labels",
    ),
    "mount of no volume": (
        "training-job.yaml", lambda d: _pod(d)["volumes"].pop(0),
        "container train: no volume 'ckptd-run'",
    ),
    "pod failure policy with OnFailure": (
        "training-job.yaml", lambda d: _pod(d).update(restartPolicy="OnFailure"),
        "spec.podFailurePolicy needs restartPolicy Never",
    ),
    "replacement while terminating": (
        "training-job.yaml", lambda d: d["spec"].update(podReplacementPolicy="TerminatingOrFailed"),
        "spec.podReplacementPolicy must be Failed with a podFailurePolicy",
    ),
    "exit codes of no container": (
        "training-job.yaml",
        lambda d: d["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"].update(
            containerName="trainer"),
        "podFailurePolicy: no container 'trainer'",
    ),
    "$(VAR) in a hook": (
        "training-job.yaml",
        lambda d: _pod(d)["containers"][0]["lifecycle"]["preStop"]["exec"].update(
            command=["ckptctl", "dump", "--name", "$(JOB_NAME)"]),
        "the kubelet does not expand $(VAR) in lifecycle hooks",
    ),
    "all labels in an env var": (
        "training-job.yaml",
        lambda d: _pod(d)["containers"][0]["env"][0]["valueFrom"]["fieldRef"].update(
            fieldPath="metadata.labels"),
        "fieldPath 'metadata.labels' is not available to environment variables",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_copy_is_rejected(breakage: str, tmp_path: Path) -> None:
    """The check is not vacuous: a copy of a manifest broken in one place, written out and
    read back like the real one, fails it, naming the place."""
    name, breaks, expected = BREAKAGES[breakage]
    docs = copy.deepcopy(_docs(name))
    target = next(d for d in docs if d["kind"] in ("DaemonSet", "Job"))
    breaks(target)
    yaml = _module("yaml", "PyYAML")
    copy_path = tmp_path / name
    copy_path.write_text(yaml.safe_dump_all(docs))
    reread = _load(copy_path.read_text())
    version = kube_versions()[0]
    problems = [p for doc in reread for p in (*schema_errors(doc, version), *api_errors(doc))]
    assert any(expected in p for p in problems), problems
    assert all(not schema_errors(d, version) for d in _docs(name)), "the original is valid"


def test_daemonset() -> None:
    """What the container flow needs of the node's daemon (docs/adr/0010, 0011): the host's
    pid namespace, privileged, the host's cgroup namespace and hierarchy, the socket directory
    on the host, a store shared by every node and a state directory of the node's own."""
    docs = {d["kind"]: d for d in _docs("ckptd-daemonset.yaml")}
    assert set(docs) == {"Namespace", "DaemonSet"}
    ds = docs["DaemonSet"]
    assert ds["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"] == "ckptd-system"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["privileged"] is True
    # the host's cgroup namespace and hierarchy: CRIU is placed in the job's pod's cgroup
    # (restores land there), never this pod's
    assert container["command"] == [
        "nsenter", "--cgroup=/proc/1/ns/cgroup", "--",
        "ckptd", "--socket", "/run/ckptd/ckptd.sock", "--store", "/mnt/ckptd-store",
        "--state-dir", "/var/lib/ckptd/state", "--cgroup-fs", "/host/sys/fs/cgroup",
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    assert (host_paths["cgroup"], mounts["cgroup"]) == ("/sys/fs/cgroup", "/host/sys/fs/cgroup")
    assert (host_paths["run"], mounts["run"]) == ("/run/ckptd", "/run/ckptd")
    from ckptd.daemon.config import DaemonConfig

    # the RAM staging lies in the run directory, root's (issue 33): not the node's /dev/shm
    assert DaemonConfig.fast_staging_dir.startswith(host_paths["run"] + "/")
    assert "/dev/shm" not in host_paths.values()
    # the store is shared by every node (a restore may happen on any); the state is not
    assert "nfs" in volumes["store"] and mounts["store"] == "/mnt/ckptd-store"
    assert (host_paths["state"], mounts["state"]) == ("/var/lib/ckptd/state",) * 2
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert "ckptctl" in container["livenessProbe"]["exec"]["command"]


def test_stop_timeouts_outlast_the_daemons_stop_a_driver_call_included() -> None:
    """Issue 23: systemd's TimeoutStopSec and the DaemonSet's grace period exceed the
    longest stop of a daemon with the default configuration — which waits out a CUDA driver
    call (gpu_call_timeout_s) — with a margin, so a stop mid-checkpoint never kills the
    daemon inside the call."""
    from ckptd.daemon.config import DaemonConfig, operations_wait_s, stop_bound_s

    config = DaemonConfig()
    bound = stop_bound_s(config)
    assert operations_wait_s(config) >= config.gpu_call_timeout_s + config.shutdown_grace_s
    assert bound >= operations_wait_s(config) + 2 * config.shutdown_grace_s
    unit = (ROOT / "systemd" / "ckptd.service").read_text()
    (stop,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    ds = {d["kind"]: d for d in _docs("ckptd-daemonset.yaml")}["DaemonSet"]
    grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    margin = 60
    assert int(stop) >= bound + margin, (stop, bound)
    assert grace >= bound + margin, (grace, bound)


def _run_options(command: list[str]) -> dict[str, str]:
    """``ckptctl [--socket S] run [--opt V]... -- CMD``'s options, by name (``socket`` too)."""
    assert command[0] == "ckptctl" and "run" in command and "--" in command, command
    options = command[1:command.index("--")]
    options.remove("run")
    assert len(options) % 2 == 0, options
    return {options[i].removeprefix("--"): options[i + 1] for i in range(0, len(options), 2)}


def test_training_job() -> None:
    """The container flow (deploy/README.md, "Pod eviction and resume, step by step"): pid 1
    is ``ckptctl run --name $(JOB_NAME)``, NAME the Job's name in every pod; preStop dumps
    by that name; exit 143 (checkpointed and stopped) and disruptions are not failures; the
    next pod starts once this one has ended; the grace period covers ``--grace``; the
    socket's host directory and a volume for the job's files are mounted; no privileges."""
    docs = {d["kind"]: d for d in _docs("training-job.yaml")}
    assert set(docs) == {"PersistentVolumeClaim", "Job"}
    job, claim = docs["Job"], docs["PersistentVolumeClaim"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]

    command = container["command"]
    assert command[:4] == ["ckptctl", "--socket", "/run/ckptd/ckptd.sock", "run"], command
    assert command[command.index("--") + 1:] == ["python", "train.py"]
    options = _run_options(command)
    assert options["name"] == "$(JOB_NAME)"
    env = {e["name"]: e for e in container["env"]}
    assert env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/job-name']"

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["sh", "-c"]
    assert "ckptctl --socket /run/ckptd/ckptd.sock dump --name \"$JOB_NAME\"" in pre_stop[2]

    assert pod["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    ignored_codes = {code for r in rules if r["action"] == "Ignore" and "onExitCodes" in r
                     and r["onExitCodes"]["operator"] == "In"
                     and r["onExitCodes"].get("containerName") in (None, container["name"])
                     for code in r["onExitCodes"]["values"]}
    assert 143 in ignored_codes
    assert any(r["action"] == "Ignore" and {"type": "DisruptionTarget", "status": "True"} in
               r.get("onPodConditions", []) for r in rules)
    assert spec["backoffLimit"] >= 1

    grace = float(options["grace"])
    assert grace >= 120 and grace + 20 <= pod["terminationGracePeriodSeconds"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    (run,) = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == "/run/ckptd"]
    assert mounts[run]["mountPath"] == "/run/ckptd"
    assert volumes[run]["hostPath"]["type"] == "Directory"
    (data,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert volumes[data]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert mounts[data]["mountPath"] == "/data"

    limits = container["resources"]["limits"]
    assert {"memory", "nvidia.com/gpu"} <= set(limits)
    # the training pod needs no privileges (the daemon has them)
    security = container["securityContext"]
    assert not security.get("privileged") and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert not pod.get("hostPID") and not pod.get("shareProcessNamespace")
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize(
    "script", ["slurm/train.sbatch", "slurm/prolog.sh", "slurm/epilog.sh"]
)
def test_shell_scripts_parse(script: str) -> None:
    proc = subprocess.run(
        ["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_sbatch_names_follow_ckptds_name_rule() -> None:
    """A Slurm job name may hold spaces and parentheses; the checkpoint name made of it must
    pass ckptd's name rule (``validate.valid_name``)."""
    from ckptd.transport.validate import valid_name

    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("safe=", "case $safe", "NAME="))]
    for job in ("my train (v2)", "-x", "ok.name", "ü" * 200):
        script = "\n".join(lines) + '\nprintf %s "$NAME"'
        env = {"SLURM_JOB_NAME": job, "SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"}
        proc = subprocess.run(["bash", "-c", script], check=False, capture_output=True,
                              text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        assert valid_name(proc.stdout), (job, proc.stdout)


def test_sbatch_directives() -> None:
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@120" in text
    assert "#SBATCH --requeue" in text
    assert 'NAME="$safe-$SLURM_JOB_ID"' in text
    # outside a container `ckptctl run` does not restore: the requeued run does, by name
    assert "ckptctl restore --name" in text
    # the checkpoint on SIGTERM fits in the time --signal leaves before the limit
    lead = re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", text, re.M)
    grace = re.search(r"^GRACE=(\d+) ", text, re.M)
    assert lead and grace and '--grace "$GRACE"' in text
    assert int(grace.group(1)) < int(lead.group(1))
