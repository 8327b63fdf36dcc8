"""``ckptctl check``'s container facts (issue 24, 6): the cgroup hierarchy, the OCI runtimes
and podman's default one, CAP_SYS_RESOURCE, and a one-line warning with what to do for each
problem a user would otherwise meet as a container that does not start. Files and a stub for
``podman info``; no root, no podman."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from ckptd.adapters.procfs.runtime import (
    RuntimeProbe,
    cgroup_hierarchy,
    has_capability,
    podman_configured_runtime,
    runtime_warnings,
)
from ckptd.daemon.probe import NodeProbe
from ckptd.domain import CriuStatus, NodeReport, RuntimeFacts
from ckptd.transport.cli import convert, render
from ckptd.transport.grpc.convert import check_response

# Debian 12 under a container manager: v1 controllers, systemd's cgroup2 at .../unified.
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
LEGACY = """\
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
CAPS_WITHOUT_SYS_RESOURCE = "Name:\tx\nCapEff:\t000001fffeffffff\n"  # this test machine's root
CAPS_FULL = "Name:\tx\nCapEff:\t000001ffffffffff\n"


@pytest.mark.parametrize(("text", "want"), [
    (HYBRID, "hybrid"), (UNIFIED, "unified"), (LEGACY, "legacy"), ("", ""),
    # a named v1 hierarchy without controllers beside cgroup v2 is still unified for crun
    (UNIFIED + "50 31 0:40 / /run/x rw - cgroup cgroup rw,name=systemd\n", "unified"),
])
def test_the_cgroup_hierarchy_is_read_from_mountinfo(text: str, want: str) -> None:
    assert cgroup_hierarchy(text) == want


def test_cap_sys_resource_is_bit_24_of_capeff() -> None:
    assert has_capability(CAPS_FULL, 24)
    assert not has_capability(CAPS_WITHOUT_SYS_RESOURCE, 24)
    assert has_capability(CAPS_WITHOUT_SYS_RESOURCE, 21)  # CAP_SYS_ADMIN
    assert not has_capability("Name:\tx\n", 24)


def test_podman_s_runtime_is_the_last_containers_conf_that_sets_it() -> None:
    shipped = '[engine]\n#runtime = "crun"\n'
    assert podman_configured_runtime([shipped]) == ""
    assert podman_configured_runtime([shipped, '[engine]\nruntime = "runc"\n']) == "runc"
    assert podman_configured_runtime(
        ['[engine]\nruntime = "runc"\n', '[engine]\nruntime = "crun"\n', "[containers]\n"]
    ) == "crun"
    assert podman_configured_runtime(["this is [not toml", '[engine]\nruntime="runc"']) == "runc"


def one_line(warnings: Sequence[str]) -> None:
    for w in warnings:
        assert "\n" not in w and w.strip() == w


def test_hybrid_cgroups_with_podman_on_crun_say_use_runc() -> None:
    facts = RuntimeFacts(cgroup="hybrid", cap_sys_resource=True,
                         oci_runtimes=("/usr/sbin/runc", "/usr/bin/crun"), podman_runtime="crun")
    (warning,) = runtime_warnings(facts)
    one_line([warning])
    assert "hybrid" in warning and "podman's default OCI runtime is crun" in warning
    assert "--runtime runc" in warning and 'runtime = "runc"' in warning
    assert "systemd.unified_cgroup_hierarchy=1" in warning


def test_hybrid_cgroups_with_crun_but_no_runc_say_install_runc() -> None:
    (warning,) = runtime_warnings(RuntimeFacts(cgroup="hybrid", oci_runtimes=("/usr/bin/crun",)))
    assert "install runc" in warning


@pytest.mark.parametrize("facts", [
    RuntimeFacts(cgroup="unified", oci_runtimes=("/usr/bin/crun",), podman_runtime="crun"),
    RuntimeFacts(cgroup="hybrid", oci_runtimes=("/usr/sbin/runc",), podman_runtime="runc"),
    RuntimeFacts(cgroup="hybrid"),  # no container runtime at all: nothing to say
])
def test_no_warning_where_nothing_would_fail(facts: RuntimeFacts) -> None:
    assert runtime_warnings(facts) == ()


def test_no_cap_sys_resource_says_ulimit_and_how_to_grant_it() -> None:
    (warning,) = runtime_warnings(RuntimeFacts(cgroup="unified", cap_sys_resource=False))
    one_line([warning])
    assert "CAP_SYS_RESOURCE" in warning
    assert "--ulimit nofile=" in warning and "--ulimit nproc=" in warning
    assert "other uids' jobs" in warning and "CapabilityBoundingSet" in warning


class Stub:
    """``podman info``: answers ``answer`` (or raises it), counting the calls."""

    def __init__(self, answer: str | Exception) -> None:
        self.answer = answer
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append((list(argv), timeout))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def probe_at(tmp_path: Path, mountinfo: str, status: str, found: dict[str, str],
             confs: Sequence[str], run: Stub) -> RuntimeProbe:
    proc = tmp_path / "self"
    proc.mkdir(exist_ok=True)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "status").write_text(status)
    paths = []
    for i, text in enumerate(confs):
        path = tmp_path / f"{i}.conf"
        path.write_text(text)
        paths.append(path)
    return RuntimeProbe(proc_self=proc, conf_files=lambda: paths, which=found.get, run=run)


def test_the_probe_reads_this_kind_of_node_and_warns_twice(tmp_path: Path) -> None:
    """The test machine itself: hybrid cgroups, runc and crun, podman on crun by default
    (nothing in containers.conf: podman info says), root without CAP_SYS_RESOURCE."""
    podman = tmp_path / "podman"
    podman.write_text("")
    run = Stub("crun\n")
    probe = probe_at(tmp_path, HYBRID, CAPS_WITHOUT_SYS_RESOURCE,
                     {"runc": "/usr/sbin/runc", "crun": "/usr/bin/crun", "podman": str(podman)},
                     ['[engine]\n#runtime = "crun"\n'], run)
    facts = probe()
    assert facts.cgroup == "hybrid"
    assert facts.cap_sys_resource is False
    assert facts.oci_runtimes == ("/usr/sbin/runc", "/usr/bin/crun")
    assert facts.podman_runtime == "crun"
    assert len(facts.warnings) == 2
    assert "--runtime runc" in facts.warnings[0] and "CAP_SYS_RESOURCE" in facts.warnings[1]
    (argv, timeout), = run.calls
    assert argv == [str(podman), "info", "--format", "{{.Host.OCIRuntime.Name}}"]
    assert timeout <= 5
    probe()
    assert len(run.calls) == 1, "podman info is asked once per podman binary"


def test_containers_conf_answers_without_running_podman(tmp_path: Path) -> None:
    run = Stub(AssertionError("podman info must not run"))
    probe = probe_at(tmp_path, UNIFIED, CAPS_FULL,
                     {"crun": "/usr/bin/crun", "podman": "/usr/bin/podman"},
                     ['[engine]\n#runtime = "crun"\n', '[engine]\nruntime = "/usr/bin/crun"\n'],
                     run)
    facts = probe()
    assert (facts.cgroup, facts.cap_sys_resource, facts.podman_runtime) == ("unified", True,
                                                                           "crun")
    assert facts.warnings == ()
    assert run.calls == []


def test_a_podman_that_hangs_is_unknown_and_asked_again(tmp_path: Path) -> None:
    podman = tmp_path / "podman"
    podman.write_text("")
    run = Stub(subprocess.TimeoutExpired(["podman"], 3))
    probe = probe_at(tmp_path, HYBRID, CAPS_FULL, {"podman": str(podman)}, [], run)
    assert probe().podman_runtime == ""
    assert probe().podman_runtime == ""
    assert len(run.calls) == 2


def test_no_podman_no_runtimes_unreadable_files(tmp_path: Path) -> None:
    run = Stub(AssertionError("podman info must not run"))
    facts = RuntimeProbe(proc_self=tmp_path / "gone", conf_files=list, which=lambda _: None,
                         run=run)()
    assert (facts.cgroup, facts.cap_sys_resource) == ("", False)  # unknown: no cap assumed
    assert facts.oci_runtimes == () and facts.podman_runtime == ""
    assert len(facts.warnings) == 1 and "CAP_SYS_RESOURCE" in facts.warnings[0]


def test_the_facts_travel_to_ckptctl_check(tmp_path: Path) -> None:
    """NodeProbe -> CheckResponse -> ckptctl check's text and --json."""
    facts = RuntimeFacts(cgroup="hybrid", cap_sys_resource=False,
                         oci_runtimes=("/usr/sbin/runc", "/usr/bin/crun"), podman_runtime="crun")
    facts = RuntimeFacts(**{**facts.__dict__, "warnings": runtime_warnings(facts)})
    report = NodeReport(node="n", kernel="6.1", criu=CriuStatus("/c", "4.2.1", True, ""),
                        runtime=facts)
    data = convert.check_to_dict(check_response(report, "0.1"))
    assert data["cgroup_hierarchy"] == "hybrid"
    assert data["cap_sys_resource"] is False
    assert data["oci_runtimes"] == ["/usr/sbin/runc", "/usr/bin/crun"]
    assert data["podman_runtime"] == "crun"
    assert data["warnings"] == list(facts.warnings)
    text = render.check_report(data)
    assert "cgroups:          hybrid" in text
    assert "oci runtimes:     /usr/sbin/runc, /usr/bin/crun (podman's default: crun)" in text
    assert "cap_sys_resource: NO" in text
    lines = text.splitlines()
    assert lines[-2:] == [f"WARNING: {w}" for w in facts.warnings]

    quiet = render.check_report(convert.check_to_dict(check_response(
        NodeReport(node="n", kernel="6.1", criu=CriuStatus("/c", "4.2.1", True, "")), "0.1")))
    assert "WARNING" not in quiet and "cgroups" not in quiet  # an older daemon: nothing said


def test_node_probe_asks_the_runtime_probe_on_each_check() -> None:
    calls = []

    def runtime() -> RuntimeFacts:
        calls.append(1)
        return RuntimeFacts(cgroup="unified")

    class Criu:
        def status(self) -> CriuStatus:
            return CriuStatus("/c", "4.2.1", False, "no")

    class Gpu:
        def node_inventory(self) -> object:
            from ckptd.domain import GpuInventory
            return GpuInventory(available=False, message="no NVML")

    probe = NodeProbe(Criu(), "n", "/s", Gpu(), runtime)  # type: ignore[arg-type]
    assert probe().runtime.cgroup == "unified"
    probe()
    assert len(calls) == 2


def test_check_reports_lazy_pages_as_the_lazy_restore_asks_it(tmp_path: Path) -> None:
    """Issue 34, 8: ``ckptctl check`` said ``lazy_pages FAIL`` where ``restore --lazy`` works,
    because it asked CRIU for a feature named lazy_pages, which CRIU does not know. A CRIU
    stand-in that answers ``criu check --feature`` as CRIU 4.2 does (its real names only)."""
    from ckptd.adapters.criu import CriuSwrk

    criu = tmp_path / "criu"
    criu.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Version: 4.2.1"; exit 0; fi\n'
        'if [ "$1 $2" = "check --feature" ]; then\n'
        '  case "$3" in uffd-noncoop|network_lock_nftables) echo "$3 is supported"; exit 0;;\n'
        '    mem_dirty_track) exit 1;; esac\n'
        '  echo "Error (criu/cr-check.c:1908): Unknown feature $3" >&2; exit 1\n'
        "fi\n"
        'if [ "$1" = check ]; then echo "Looks good."; exit 0; fi\n'
        "exit 1\n")
    criu.chmod(0o755)

    class Gpu:
        def node_inventory(self) -> object:
            from ckptd.domain import GpuInventory
            return GpuInventory(available=False, message="no NVML")

    swrk = CriuSwrk(str(criu), plugin_dir=tmp_path)
    report = NodeProbe(swrk, "n", "/s", Gpu())()  # type: ignore[arg-type]
    features = {f.name: f.ok for f in report.features}
    assert features == {"mem_dirty_track": False, "lazy_pages": True,
                        "network_lock_nftables": True}
    assert features["lazy_pages"] is swrk.lazy_restores()  # what restore --lazy is told
