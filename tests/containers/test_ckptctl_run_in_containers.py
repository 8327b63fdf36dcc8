"""Issue #12's flow through the daemon: ``ckptctl run --name J -- CMD`` as container A's init
(the daemon's socket directory bind-mounted in), ``ckptctl dump --name J`` (the preStop path),
A removed, container B started with the same ``ckptctl run``, which should restore J into B.

Not built yet (strict xfail): the dump is refused before anything is frozen, because the job is
not the init of its pid namespace (core/targets.py ``check_namespaces``), and ``ckptctl run``
does not look for a checkpoint of J. The raw-CRIU flow in test_container_restore.py shows what
the daemon must do; docs/design/containers.md ("Integration into ckptd") the steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from integration.support import Daemon, run_ckptctl

from .bundle import venv_dir
from .flow import Flow, criu_binary
from .runtime import OciContainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NOT_YET = (
    "ckptd refuses to dump a job that is not its pid namespace's init (core/targets.py "
    "check_namespaces: 'is pid N inside a pid namespace of its own, not that namespace's "
    "init'), and ckptctl run does not restore a checkpoint of J into its container yet "
    "(issue #12; docs/design/containers.md, 'Integration into ckptd')"
)


@pytest.mark.xfail(strict=True, reason=NOT_YET, raises=AssertionError)
def test_ckptctl_run_job_moves_from_container_a_to_container_b(
    make_flow: Callable[..., Flow], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    daemon = Daemon(tmp_path / "ckptd", "--criu", criu_binary(), socket_dir=run_dir)
    flow = make_flow()
    flow.prepare()
    ctl = ["python3", "-m", "ckptd.transport.cli.main", "--socket", "/run/ckptd/ckptd.sock",
           "run", "--name", "ct-job", "--", *flow.job_argv()]

    def container(name: str) -> OciContainer:
        c = flow.container(name, ctl)
        c.spec.volumes = {flow.data: Path("/data"), run_dir: Path("/run/ckptd")}
        c.__post_init__()
        return c

    a = container("a")
    b: OciContainer | None = None
    try:
        a.run()
        a.wait_for_output(f"step {flow.dump_after_step} ", timeout=30)
        dump = run_ckptctl(daemon.socket, "dump", "--name", "ct-job", timeout=60)
        assert dump.rc == 0, f"ckptctl dump --name ct-job: {dump.err.strip()}"
        assert a.wait(timeout=30) == 143
        a.delete()
        b = container("b")
        b.run()
        assert b.wait(timeout=60) == flow.exit_status, b.err.read_text()
        out, _, _ = flow.reference()
        assert a.out.read_bytes() + b.out.read_bytes() == out
    finally:
        a.delete()
        if b is not None:
            b.delete()
        assert daemon.stop() == 0, daemon.log()[-3000:]
    assert os.path.isdir(venv_dir())
