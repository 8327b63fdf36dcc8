"""Issue #12's flow through the daemon: ``ckptctl run --name J -- CMD`` as container A's init
(the daemon's socket directory bind-mounted in), ``ckptctl dump --name J`` (the preStop path),
A removed, container B started with the same ``ckptctl run``, which restores J into B.

The daemon sees that J is a job of a container (core/targets.py ``container_init``) and runs
CRIU inside A (adapters/criu/variants.py, ``CriuDumpJob.container``); B's ``ckptctl run`` finds
the newest checkpoint of J and asks for it INTO its container (core/intocontainer.py): the
job's pids free there, the files it maps unchanged in B's root, then CRIU run inside B; the
job is B's init's child, in B's namespaces, cgroups and root, writing to B's stdout.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from integration.support import Daemon, run_ckptctl

from ckptd.adapters.criu.containers import Container

from .bundle import venv_dir
from .flow import Flow, criu_binary
from .runtime import OciContainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

@dataclass
class Setup:
    flow: Flow
    daemon: Daemon
    run_dir: Path

    def container(
        self, name: str, *, run_dir: Path | None = None, binds: dict[Path, Path] | None = None,
        options: tuple[str, ...] = (),
    ) -> OciContainer:
        """A container whose init is ``ckptctl run --name ct-job -- <the flow's job>``,
        talking to the daemon whose socket directory is ``run_dir`` (default: ``daemon``'s);
        ``binds``: more node paths mounted over the container's (a file of another image)."""
        ctl = ["python3", "-m", "ckptd.transport.cli.main", "--socket",
               "/run/ckptd/ckptd.sock", "run", "--name", "ct-job", *options, "--",
               *self.flow.job_argv()]
        c = self.flow.container(name, ctl)
        c.spec.volumes = {self.flow.data: Path("/data"), (run_dir or self.run_dir):
                          Path("/run/ckptd"), **(binds or {})}
        c.__post_init__()
        return c


@pytest.fixture
def setup(make_flow: Callable[..., Flow], tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[Setup]:
    """A daemon and a flow; ``engine`` from an indirect parameter (default runc)."""
    engine = getattr(request, "param", "oci")
    if engine == "podman" and shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman; scripts/test.sh does)")
    run_dir = tmp_path / "run"
    daemon = Daemon(tmp_path / "ckptd", "--criu", criu_binary(), socket_dir=run_dir)
    flow = make_flow(engine=engine)
    flow.prepare()
    try:
        yield Setup(flow, daemon, run_dir)
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    assert os.path.isdir(venv_dir())


def _job_of(a: OciContainer) -> tuple[int, int]:
    """The node pid and A's pid of ckptctl run's child (the job's root)."""
    init = a.init_pid()
    kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert len(kids) == 1, f"A's init has children {kids}"
    job = int(kids[0])
    with Container.open(init) as ns:
        ns_pid = next(p for p, n in ns.node_pids().items() if n == job)
    return job, ns_pid


def _check_checkpoint(setup: Setup, dumped: object, job: int, ns_pid: int) -> None:
    assert isinstance(dumped, dict), dumped
    shown = run_ckptctl(setup.daemon.socket, "show", dumped["id"])
    assert shown.rc == 0, shown.err
    ck = shown.out
    assert isinstance(ck, dict), ck
    ck = ck.get("checkpoint", ck)
    assert ck.get("container") is True, ck
    assert ck["frozen_s"] > 0  # CRIU's stats, written among the images, were found
    procs = ck["processes"]
    assert procs[0]["pid"] == job
    assert procs[0].get("nsPid", procs[0].get("ns_pid")) == ns_pid
    inner = [p.get("nsPid", p.get("ns_pid")) for p in procs]
    # ckptctl run had the daemon reserve the low pids of A's pid namespace (ReservePids): the
    # job's pids are above them, so they will be free in the next container
    assert all(isinstance(p, int) and p > 1000 for p in inner), procs
    assert len(procs) >= 2  # sh and the writer
    for p in procs:  # killed after the commit
        assert not Path(f"/proc/{p['pid']}").exists() or \
            Path(f"/proc/{p['pid']}/stat").read_text().split(") ")[1][0] in "ZX"


@pytest.mark.parametrize("by", ["name", "pid", "init", "cgroup"])
def test_ckptctl_dump_of_a_job_in_a_container(setup: Setup, by: str) -> None:
    """``ckptctl run`` as A's init; the job is checkpointed through the daemon (by name, the
    preStop path; by its node pid; by the container, given as its init's pid or its cgroup),
    CRIU run inside A: the checkpoint is a container one with the processes' pids in A, the
    job is killed, and A's init exits: 143 when the dump drained J by name, else with the
    killed job's status."""
    a = setup.container("a")
    try:
        a.run()
        a.wait_for_output(f"step {setup.flow.dump_after_step} ", timeout=30)
        job, ns_pid = _job_of(a)
        init = a.init_pid()
        cgroup = next(ln.split("::", 1)[1] for ln in
                      Path(f"/proc/{init}/cgroup").read_text().splitlines()
                      if ln.startswith("0::"))
        target = {"name": ["--name", "ct-job"], "pid": [job], "init": [init],
                  "cgroup": ["--cgroup", cgroup]}[by]
        dump = run_ckptctl(setup.daemon.socket, "dump", *target, timeout=60)
        assert dump.rc == 0, f"ckptctl dump {target}: {dump.err.strip()}"
        # by name the dump drains J (ckptctl run says so, 143); otherwise it only kills the job
        assert a.wait(timeout=30) == (143 if by == "name" else 128 + 9)
        _check_checkpoint(setup, dump.out, job, ns_pid)
        if by == "pid":  # a restore on the node is refused: only a container takes it
            assert isinstance(dump.out, dict)
            restore = run_ckptctl(setup.daemon.socket, "restore", dump.out["id"], timeout=60)
            assert restore.rc != 0
            assert "can only be restored inside a container" in restore.err, restore.err
            shown = run_ckptctl(setup.daemon.socket, "show", dump.out["id"])
            assert shown.rc == 0, shown.err
    finally:
        a.delete()


def _checkpoint_in_a(setup: Setup) -> OciContainer:
    """A runs J to the flow's dump step; J is checkpointed by name (preStop); A exits 143
    and is deleted."""
    a = setup.container("a")
    try:
        a.run()
        a.wait_for_output(f"step {setup.flow.dump_after_step} ", timeout=30)
        dump = run_ckptctl(setup.daemon.socket, "dump", "--name", "ct-job", timeout=60)
        assert dump.rc == 0, f"ckptctl dump --name ct-job: {dump.err.strip()}"
        assert a.wait(timeout=30) == 143
    finally:
        a.delete()
    return a


def _restored_job_of(b: OciContainer) -> int:
    """The node pid of the job restored into B (B's init's only child), once B says so."""
    b.wait_for_output_err("restored from", timeout=60)
    init = b.init_pid()
    kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert len(kids) == 1, f"B's init has children {kids}"
    return int(kids[0])


def _continues_bit_for_bit(setup: Setup, a: OciContainer, b: OciContainer) -> None:
    out, log, state = setup.flow.reference()
    assert a.out.read_bytes() + b.out.read_bytes() == out
    assert (setup.flow.data / "train.log").read_bytes() == log
    assert (setup.flow.data / "state.bin").read_bytes() == state


@pytest.mark.parametrize("setup", ["oci", "podman"], indirect=True)
def test_ckptctl_run_job_moves_from_container_a_to_container_b(setup: Setup) -> None:
    """The preStop path, then the next "pod": B's ``ckptctl run --name ct-job`` restores J
    into B. /proc says the job is B's init's child in all of B's namespaces, cgroups and
    root, with the same pid in B as in A; B exits with the job's status; stdout (A's then
    B's), the job's log and state equal an uninterrupted run's, bit for bit."""
    flow = setup.flow
    a = _checkpoint_in_a(setup)
    b = setup.container("b")
    try:
        b.run()
        job = _restored_job_of(b)
        seen = flow.observe(job, b.init_pid())
        assert seen["ppid_is_b_init"] is True, seen
        assert seen["namespaces_equal"] == dict.fromkeys(seen["namespaces_equal"], True), seen
        assert seen["cgroup_equal"] is True and seen["root_equal"] is True, seen
        assert isinstance(seen["ns_pid"], int) and seen["ns_pid"] > 1000, seen
        assert b.wait(timeout=60) == flow.exit_status, b.err.read_text()
        _continues_bit_for_bit(setup, a, b)
    finally:
        b.delete()


def test_restore_into_a_container_whose_root_differs_is_refused(
    setup: Setup, tmp_path: Path
) -> None:
    """B's image differs in a file the job maps (its Python executable, one byte longer):
    B's ``ckptctl run`` exits 1 with one line naming that file, starts nothing, and the
    checkpoint is untouched: a third container with the right image restores it."""
    a = _checkpoint_in_a(setup)
    exe = Path(os.path.realpath(sys.executable))
    other = tmp_path / "other-python"
    shutil.copy2(exe, other)
    with open(other, "ab") as f:
        f.write(b"\0")
    b = setup.container("b", binds={other: exe})
    try:
        b.run()
        assert b.wait(timeout=60) == 1, b.err.read_text()
        lines = [ln for ln in b.err.read_text().splitlines() if ln.strip()]
        assert len(lines) == 1, lines
        assert f"file {exe}" in lines[0] and "does not fit the container" in lines[0], lines
        assert "nothing was started" in lines[0]
        assert b.out.read_bytes() == b""
    finally:
        b.delete()
    c = setup.container("c")
    try:
        c.run()
        assert c.wait(timeout=60) == setup.flow.exit_status, c.err.read_text()
        _continues_bit_for_bit(setup, a, c)
    finally:
        c.delete()


def test_job_moves_between_two_daemons_sharing_a_store(setup: Setup, tmp_path: Path) -> None:
    """Two "nodes": A talks to the first daemon, B to a second one with its own state and
    socket and the same store: B's daemon restores what A's checkpointed."""
    run2 = tmp_path / "run2"
    second = Daemon(tmp_path / "ckptd2", "--criu", criu_binary(), "--store",
                    str(setup.daemon.store), socket_dir=run2)
    try:
        a = _checkpoint_in_a(setup)
        b = setup.container("b", run_dir=run2)
        try:
            b.run()
            assert b.wait(timeout=60) == setup.flow.exit_status, b.err.read_text()
            _continues_bit_for_bit(setup, a, b)
        finally:
            b.delete()
        assert "restored" in second.log()
    finally:
        assert second.stop() == 0, second.log()[-3000:]


def test_fresh_on_failure_starts_the_command_when_the_restore_is_refused(
    setup: Setup, tmp_path: Path
) -> None:
    """With ``--fresh-on-failure`` a refused restore says why in one line and starts the
    command afresh: its whole output is an uninterrupted run's."""
    _checkpoint_in_a(setup)
    exe = Path(os.path.realpath(sys.executable))
    other = tmp_path / "other-python"
    shutil.copy2(exe, other)
    with open(other, "ab") as f:
        f.write(b"\0")
    for name in ("train.log", "state.bin"):
        (setup.flow.data / name).unlink(missing_ok=True)
    b = setup.container("b", binds={other: exe}, options=("--fresh-on-failure",))
    try:
        b.run()
        assert b.wait(timeout=60) == setup.flow.exit_status, b.err.read_text()
        assert "starting it afresh (--fresh-on-failure)" in b.err.read_text()
        out, _, _ = setup.flow.reference()
        assert b.out.read_bytes() == out
    finally:
        b.delete()


def test_ckptctl_dump_leave_running_of_a_job_in_a_container(setup: Setup) -> None:
    """``--leave-running``: CRIU inside A lets the job go on; it runs to its end and A's init
    exits with its status."""
    a = setup.container("a")
    try:
        a.run()
        a.wait_for_output(f"step {setup.flow.dump_after_step} ", timeout=30)
        job, ns_pid = _job_of(a)
        dump = run_ckptctl(setup.daemon.socket, "dump", "--leave-running", job, timeout=60)
        assert dump.rc == 0, dump.err.strip()
        assert isinstance(dump.out, dict)
        shown = run_ckptctl(setup.daemon.socket, "show", dump.out["id"])
        assert shown.rc == 0 and isinstance(shown.out, dict), shown.err
        ck = shown.out.get("checkpoint", shown.out)
        assert ck["container"] is True and ck["processes"][0]["ns_pid"] == ns_pid
        assert a.wait(timeout=60) == setup.flow.exit_status
        out, _, _ = setup.flow.reference()
        assert a.out.read_bytes() == out
    finally:
        a.delete()
