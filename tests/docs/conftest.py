"""The documentation tier: the README and the manual in docs/ (issue 28).

Its checks that need nothing but the checkout's .venv (the manual builds strictly, the
generated reference and the plots are current, links and anchors resolve, every shell example
is run or marked) run everywhere; the two that run the README's commands against a real
daemon (``integration``: root and a working CRIU) use the integration tier's fixtures,
imported from tests/integration/conftest.py, and are skipped with its reason elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.*` is imported from the checkout
    sys.path.insert(0, str(REPO))

from tests.integration.conftest import (  # noqa: E402
    procs,
    start_daemon,
    tier_skip_reason,
    workloads,
)

__all__ = ["procs", "start_daemon", "workloads"]

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("integration"):
            reason = tier_skip_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
