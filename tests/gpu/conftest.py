"""Fixtures of the GPU tier's checkpoint tests (``test_gpu_cycle.py``; what they need is in
``gpu_support.py``). Nothing here applies to the other tests of this directory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.*` is imported from the checkout
    sys.path.insert(0, str(REPO))

from tests.gpu.gpu_support import cycle_skip_reason  # noqa: E402
from tests.integration.conftest import criu_path  # noqa: E402
from tests.integration.support import Daemon, Procs  # noqa: E402


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One ``ckptd`` for the module, with the CRIU the integration tier uses."""
    reason = cycle_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    path = criu_path()
    daemon = Daemon(tmp_path_factory.mktemp("ckptd-gpu"), *(["--criu", path] if path else []))
    try:
        yield daemon
    finally:
        rc = daemon.stop()
        assert rc == 0, f"ckptd exited {rc} after SIGTERM; its log:\n{daemon.log()[-4000:]}"


@pytest.fixture
def procs() -> Iterator[Procs]:
    registry = Procs()
    try:
        yield registry
    finally:
        registry.cleanup()
