"""The integration tier: real CRIU on real processes, through the real daemon and CLI.

The whole tier is skipped, with the reason, when not root or when ``criu check`` fails.
Fixtures:

- ``daemon``: one ``ckptd`` per test module (temp store, state and socket); SIGTERM at the end
  of the module, which must make it exit 0;
- ``start_daemon``: more daemons for one test (own socket/store, extra flags, a TOML config);
  stopped the same way at the end of the test;
- ``ckptctl``: ``ckptctl(*args) -> (rc, json or text, stderr)`` against ``daemon``;
- ``workloads``: ``make -C native/workloads`` once per session; the ``bin`` directory;
- ``procs``: processes a test started or restored, SIGKILLed with their descendants at the end
  of the test (restored processes are not our children: they are killed by pid).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.config import DEFAULT_CRIU_PATHS

from .support import (
    WORKLOADS_BIN,
    WORKLOADS_DIR,
    CtlResult,
    Daemon,
    Procs,
    criu_path,
    running_daemon,
)

HERE = Path(__file__).resolve().parent


@functools.cache
def tier_skip_reason() -> str | None:
    """Why the tier cannot run here, or None."""
    if os.geteuid() != 0:
        return (
            f"integration tier needs root (CRIU dumps and restores other processes); "
            f"running as uid {os.geteuid()}"
        )
    criu = criu_path()
    if criu is None:
        return (
            "integration tier needs CRIU: no criu binary found (looked at "
            f"{', '.join(DEFAULT_CRIU_PATHS)} and PATH)"
        )
    try:
        check = subprocess.run(
            [criu, "check"], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"integration tier needs a working CRIU: `{criu} check` could not run: {exc}"
    if check.returncode != 0:
        lines = [ln for ln in (check.stderr + check.stdout).splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        return (
            f"integration tier needs a working CRIU: `{criu} check` failed "
            f"(exit {check.returncode}): {last}"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    ours = [item for item in items if HERE in item.path.parents]
    if not ours:
        return
    for item in ours:
        if item.get_closest_marker("integration") is None:
            raise pytest.UsageError(f"{item.nodeid} is not marked @pytest.mark.integration")
    reason = tier_skip_reason()
    if reason is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def workloads() -> Path:
    """The workloads' bin directory, built once per session."""
    build = subprocess.run(
        ["make", "-C", str(WORKLOADS_DIR)], capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert build.returncode == 0, f"make -C native/workloads failed:\n{build.stderr}"
    return WORKLOADS_BIN


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, workloads: Path) -> Iterator[Daemon]:
    del workloads
    with running_daemon(tmp_path_factory.mktemp("ckptd")) as d:
        yield d


@pytest.fixture
def start_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Daemon]]:
    """``start_daemon(*flags, config=None, socket_dir=None) -> Daemon``; stopped (SIGTERM,
    exit 0 asserted) at the end of the test."""
    with contextlib.ExitStack() as started:

        def start(*extra: str, **kwargs: Any) -> Daemon:
            return started.enter_context(
                running_daemon(tmp_path_factory.mktemp("ckptd-extra"), *extra, **kwargs))

        yield start


@pytest.fixture
def ckptctl(daemon: Daemon) -> Callable[..., CtlResult]:
    """``ckptctl(*args, user=None) -> (rc, json or text, stderr)`` against the module's daemon."""
    return daemon.ctl


@pytest.fixture
def procs() -> Iterator[Procs]:
    registry = Procs()
    try:
        yield registry
    finally:
        registry.cleanup()
