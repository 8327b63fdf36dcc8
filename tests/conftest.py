"""Shared pytest set-up: the per-tier summary printed at the end of every run.

Tiers are the directories under tests/: unit and contract (no root, no CRIU), integration
(root + real CRIU), containers (root, CRIU and runc/crun/podman), jobshapes (root, CRIU and
PyTorch: real training jobs), slurm (those and a real Slurm cluster: slurm-wlm, munge), system
(the packaging: systemd unit, generated code), gpu (a GPU), docs (the README and the manual:
built strictly, current, its examples run).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest

_results: dict[str, Counter[str]] = defaultdict(Counter)
_skips: dict[str, Counter[str]] = defaultdict(Counter)


def _tier(nodeid: str) -> str:
    parts = Path(nodeid.split("::", 1)[0]).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _tier(report.nodeid)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        _results[tier][outcome] += 1
        if report.skipped and isinstance(report.longrepr, tuple):
            _skips[tier][str(report.longrepr[2]).removeprefix("Skipped: ")] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tr = terminalreporter
    tr.section("ckptd test tiers: what ran, what was skipped and why")
    for tier in ("unit", "contract", "integration", "containers", "jobshapes", "system", "gpu",
                 "docs", "slurm", "workloads_selftest"):
        counts = _results.get(tier, Counter())
        if not counts:
            tr.write_line(f"{tier:20s} no tests collected")
            continue
        text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        tr.write_line(f"{tier:20s} {text}")
        for reason, n in _skips.get(tier, Counter()).items():
            tr.write_line(f"{'':20s}   skipped {n}: {reason}")
