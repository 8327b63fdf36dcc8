"""What this node gives containers, for ``ckptctl check``: the cgroup hierarchy, the OCI
runtimes installed and podman's default one, and whether the daemon holds CAP_SYS_RESOURCE.

Cheap and bounded: a few file reads (``/proc/self/mountinfo``, ``/proc/self/status``,
containers.conf) and, only when no containers.conf names podman's runtime, one ``podman
info`` with a short timeout, remembered for as long as the podman binary is the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ckptd.domain import RuntimeFacts

CAP_SYS_RESOURCE = 24
"""Its bit in /proc/PID/status's ``CapEff``."""

RUNTIMES = ("runc", "crun")
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
"""Looked in besides the daemon's $PATH (a systemd unit's PATH may lack sbin)."""

PODMAN_INFO_TIMEOUT_S = 3.0

_V1_NAMED_ONLY = "name="  # a v1 hierarchy without controllers (name=systemd)


def cgroup_hierarchy(mountinfo: str) -> str:
    """``unified`` (cgroup2 and no v1 controller hierarchy), ``hybrid`` (v1 controllers and a
    cgroup2 mount, systemd's /sys/fs/cgroup/unified), ``legacy`` (v1 only) or ``""`` (no
    cgroup mounted) from the text of /proc/PID/mountinfo."""
    v2 = v1 = False
    for line in mountinfo.splitlines():
        _, sep, tail = line.partition(" - ")
        fields = tail.split()
        if not sep or len(fields) < 3:
            continue
        if fields[0] == "cgroup2":
            v2 = True
        elif fields[0] == "cgroup":
            opts = fields[2].split(",")
            if any(o not in ("rw", "ro") and not o.startswith(_V1_NAMED_ONLY) for o in opts):
                v1 = True
    if v1:
        return "hybrid" if v2 else "legacy"
    return "unified" if v2 else ""


def has_capability(status: str, cap: int) -> bool:
    """Whether ``CapEff`` of /proc/PID/status's text holds capability ``cap``."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def podman_configured_runtime(conf_texts: Sequence[str]) -> str:
    """``[engine] runtime`` of the last containers.conf text that sets it ("" if none)."""
    found = ""
    for text in conf_texts:
        with contextlib.suppress(tomllib.TOMLDecodeError):
            engine = tomllib.loads(text).get("engine")
            if isinstance(engine, dict) and isinstance(engine.get("runtime"), str):
                found = engine["runtime"]
    return found


def runtime_warnings(facts: RuntimeFacts) -> tuple[str, ...]:
    """One line each: what on this node keeps containers from starting, and what to do."""
    warnings: list[str] = []
    names = {os.path.basename(p) for p in facts.oci_runtimes}
    if facts.cgroup == "hybrid" and ("crun" in names or facts.podman_runtime == "crun"):
        who = ("podman's default OCI runtime is crun, which" if facts.podman_runtime == "crun"
               else "crun")
        runc = ("run containers with runc (podman run --runtime runc, or runtime = \"runc\" "
                "under [engine] in /etc/containers/containers.conf)" if "runc" in names
                else "install runc and run containers with it (podman run --runtime runc)")
        warnings.append(
            f"cgroups are hybrid (v1 controllers beside cgroup2): {who} refuses to start "
            "containers here (\"cgroups in hybrid mode not supported\"): "
            f"{runc}, or boot the node with systemd.unified_cgroup_hierarchy=1")
    if not facts.cap_sys_resource:
        warnings.append(
            "the daemon lacks CAP_SYS_RESOURCE (so, likely, does root on this node): "
            "container runtimes cannot raise a container's rlimits (podman raises nofile and "
            "nproc by default: \"setrlimit RLIMIT_NOFILE: Operation not permitted\"): start "
            "containers with limits within the node's, e.g. podman run --ulimit "
            "nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=32768:32768 (or default_ulimits "
            "in containers.conf); and CRIU cannot read the rlimits of other uids' jobs: give "
            "ckptd CAP_SYS_RESOURCE (check the unit's CapabilityBoundingSet, or the "
            "container's --cap-add / --privileged)")
    return tuple(warnings)


class RuntimeProbe:
    """``RuntimeFacts`` of this node; every path and the subprocess runner passed in (tests
    give files and a stub). Never raises: what cannot be read is reported unknown."""

    def __init__(
        self, *, proc_self: Path = Path("/proc/self"),
        conf_files: Callable[[], Sequence[Path]] | None = None,
        which: Callable[[str], str | None] | None = None,
        run: Callable[[Sequence[str], float], str] | None = None,
    ) -> None:
        self._proc_self = proc_self
        self._conf_files = conf_files or default_conf_files
        self._which = which or _which
        self._run = run or _run
        self._podman_cache: tuple[tuple[str, int], str] | None = None

    def __call__(self) -> RuntimeFacts:
        try:
            cgroup = cgroup_hierarchy((self._proc_self / "mountinfo").read_text())
        except OSError:
            cgroup = ""
        try:
            cap = has_capability((self._proc_self / "status").read_text(), CAP_SYS_RESOURCE)
        except (OSError, ValueError):
            cap = False
        runtimes = tuple(p for p in (self._which(n) for n in RUNTIMES) if p)
        facts = RuntimeFacts(cgroup=cgroup, cap_sys_resource=cap, oci_runtimes=runtimes,
                             podman_runtime=self._podman_runtime())
        return replace(facts, warnings=runtime_warnings(facts))

    def _podman_runtime(self) -> str:
        podman = self._which("podman")
        if podman is None:
            return ""
        texts = []
        for path in self._conf_files():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                texts.append(path.read_text())
        configured = podman_configured_runtime(texts)
        if configured:
            return os.path.basename(configured)
        try:
            key = (podman, os.stat(podman).st_mtime_ns)
        except OSError:
            return ""
        if self._podman_cache is None or self._podman_cache[0] != key:
            try:
                name = self._run([podman, "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                                 PODMAN_INFO_TIMEOUT_S).strip()
            except (OSError, subprocess.SubprocessError):
                return ""  # not remembered: a slow podman may answer next time
            self._podman_cache = (key, os.path.basename(name))
        return self._podman_cache[1]


def default_conf_files() -> list[Path]:
    """containers.conf files in the order podman reads them (later ones win)."""
    files = [Path("/usr/share/containers/containers.conf"),
             Path("/etc/containers/containers.conf")]
    with contextlib.suppress(OSError):
        files += sorted(Path("/etc/containers/containers.conf.d").glob("*.conf"))
    return files


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SEARCH_PATH])
    return shutil.which(name, path=path)


def _run(argv: Sequence[str], timeout: float) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=True, stdin=subprocess.DEVNULL)
    return done.stdout
