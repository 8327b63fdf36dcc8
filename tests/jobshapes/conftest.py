"""The job-shape tier: real PyTorch jobs (CPU wheel, installed by scripts/test.sh) under the
real daemon and CLI, each checked bit for bit against an uninterrupted run (issue 11).

Its tests (marked ``slow``; those that checkpoint also ``integration``) run on what the
integration tier runs on — root and a working CRIU — plus PyTorch in the checkout's .venv;
they are skipped, with the reason, without them (the workloads' own determinism check needs
only PyTorch). Its fixtures are
the integration tier's (``daemon``, ``start_daemon``, ``procs``, ``workloads``: imported from
tests/integration/conftest.py, not copied) and ``references``, the uninterrupted runs of the
workloads (made once per session, on demand).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.*` is imported from the checkout
    sys.path.insert(0, str(REPO))

from tests.integration.conftest import (  # noqa: E402
    daemon,
    procs,
    start_daemon,
    tier_skip_reason,
    workloads,
)
from tests.jobshapes.shapes import References  # noqa: E402

__all__ = ["daemon", "procs", "references", "start_daemon", "workloads"]

HERE = Path(__file__).resolve().parent


@functools.cache
def torch_skip_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return (f"job-shape tier needs PyTorch in {sys.prefix} (scripts/test.sh installs "
                "torch==2.13.0+cpu)")
    return None


def mark_slow_tier(items: list[pytest.Item], here: Path,
                   skip_reason: Callable[[pytest.Item], str | None]) -> None:
    """A slow tier's collection (this one's, tests/slurm's): every test under ``here`` must
    be marked slow (a UsageError otherwise), and is skipped with ``skip_reason(item)`` when
    that gives one."""
    for item in items:
        if here not in item.path.parents:
            continue
        if item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid} is not marked @pytest.mark.slow")
        reason = skip_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_reason(item: pytest.Item) -> str | None:
    reason = torch_skip_reason()
    if reason is None and item.get_closest_marker("integration") is not None:
        reason = tier_skip_reason()
    return reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    mark_slow_tier(items, HERE, _skip_reason)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    """Uninterrupted runs of the workloads, each made once per session when first asked."""
    return References(tmp_path_factory.mktemp("references"))
