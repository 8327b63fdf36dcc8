"""The containers tier: real containers (runc or crun with an OCI bundle, podman --rootfs) on
this machine, with CRIU run inside them (issue #12). Every test is marked ``integration`` and
``slow``; the tier is skipped, with the reason, when not root, without a working CRIU, or
without an OCI runtime (scripts/test.sh installs runc, crun and podman from Debian 12).

Fixtures: ``rootfs`` (the test root filesystem, built once per session: tests/containers/
bundle.py), ``flow`` (a ``Flow`` in the test's temporary directory, short job, that rootfs).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .bundle import build_rootfs, runtime
from .flow import Flow, FlowError, build_shim, criu_binary

HERE = Path(__file__).resolve().parent


@functools.cache
def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return f"containers tier needs root (containers, CRIU); running as uid {os.geteuid()}"
    try:
        criu = criu_binary()
    except FlowError:
        return "containers tier needs CRIU (scripts/install-criu.sh)"
    check = subprocess.run([criu, "check"], capture_output=True, text=True, check=False,
                           timeout=120)
    if check.returncode != 0:
        return f"containers tier needs a working CRIU: `{criu} check` failed"
    if runtime() is None:
        return ("containers tier needs an OCI runtime: neither runc nor crun is installed "
                "(apt-get install runc crun; scripts/test.sh does)")
    for tool in ("nsenter", "make", "gcc"):
        if shutil.which(tool) is None:
            return f"containers tier needs {tool}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    ours = [item for item in items if HERE in item.path.parents]
    for item in ours:
        for mark in ("integration", "slow"):
            if item.get_closest_marker(mark) is None:
                raise pytest.UsageError(f"{item.nodeid} is not marked @pytest.mark.{mark}")
    reason = skip_reason() if ours else None
    if reason is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("containers") / "rootfs"
    build_rootfs(path)
    build_shim()
    return path


@pytest.fixture
def make_flow(tmp_path: Path, rootfs: Path) -> Callable[..., Flow]:
    """``make_flow(**knobs) -> Flow``: a short job (60 steps of 25 ms, dumped after step 15)
    in the test's directory, on the session's root filesystem."""

    def make(**knobs: Any) -> Flow:
        settings: dict[str, Any] = {"steps": 60, "interval_ms": 25, "dump_after_step": 15,
                                    "rootfs_dir": rootfs}
        settings.update(knobs)
        return Flow(work=tmp_path / "flow", **settings)

    return make
