"""The slurm tier: deploy/slurm as shipped, on a real Slurm cluster (Debian's slurm-wlm 22.05
and munge, installed by scripts/test.sh) started by the tier itself — see ``cluster.py`` —
with real PyTorch CPU training jobs checked bit for bit against uninterrupted runs (issue 26).

Needs what the job-shape tier needs (root, a working CRIU, PyTorch in .venv) plus the Slurm
and munge binaries; skipped, with the reason, without them. Every test is ``slow``. A failing
test's report ends with the tail of every log of its cluster (slurmctld, both slurmd, munged,
both ckptd), and the cluster's directory is copied to /tmp/ckptd-slurm-logs.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.*` is imported from the checkout
    sys.path.insert(0, str(REPO))

from tests.integration.conftest import procs, tier_skip_reason  # noqa: E402
from tests.jobshapes.conftest import (  # noqa: E402
    mark_slow_tier,
    references,
    torch_skip_reason,
)
from tests.slurm.cluster import SlurmCluster, missing_binaries  # noqa: E402

__all__ = ["cluster", "procs", "references"]

HERE = Path(__file__).resolve().parent
KEPT_LOGS = Path("/tmp/ckptd-slurm-logs")
"""Where a failed test's cluster directory (logs, job outputs; no store) is copied: pytest's
own tmp_path of it goes after a few more sessions."""


@functools.cache
def slurm_skip_reason() -> str | None:
    reason = torch_skip_reason() or tier_skip_reason()
    if reason is not None:
        return reason.replace("integration tier", "slurm tier")
    missing = missing_binaries()
    if missing:
        return (f"slurm tier needs Slurm and munge (scripts/test.sh installs slurmctld slurmd "
                f"slurm-client munge from Debian): {', '.join(missing)} not on PATH")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    mark_slow_tier(items, HERE, lambda _item: slurm_skip_reason())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    report: pytest.TestReport = yield
    cluster = getattr(item, "slurm_cluster", None)
    if report.failed and isinstance(cluster, SlurmCluster):
        kept = KEPT_LOGS / f"{item.name}-{time.strftime('%Y%m%dT%H%M%S')}"
        with contextlib.suppress(OSError):
            shutil.copytree(cluster.root.parent, kept, ignore=shutil.ignore_patterns(
                "store", "*.sock", "*.socket", "munge-key", "references"),
                ignore_dangling_symlinks=True)
        report.sections.append(("slurm cluster logs", f"kept in {kept}\n" + cluster.logs()))
    return report


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SlurmCluster]:
    """A fresh cluster for the test (a few seconds to start); stopped after it."""
    c = SlurmCluster(tmp_path / "cluster")
    request.node.slurm_cluster = c
    c.start()
    try:
        yield c
    finally:
        c.close()
