"""The benchmarks' shared runner (bench.common) on a tiny workload with real CRIU: the pid a
workload start returns is the workload's own (not found by name), and raw CRIU dumps it
(killing it) and restores it, running on from where it was. Not a timed test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from .support import criu_path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import RawCriu, kill, start_bigmem, start_counter, wait_gone  # noqa: E402

pytestmark = pytest.mark.integration


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _steps(out: Path) -> int:
    return sum(1 for line in out.read_text().splitlines() if line.startswith("step"))


def test_raw_criu_dumps_and_restores_a_started_counter(workloads: Path, tmp_path: Path) -> None:
    criu = criu_path()
    assert criu is not None
    out = tmp_path / "counter.out"
    pid = start_counter(out, mib=1, interval_ms=20)
    try:
        assert _comm(pid) == "counter"  # the workload itself, not its launcher shell
        raw = RawCriu(criu)
        dump_s = raw.dump(pid, tmp_path / "images")
        wait_gone(pid)
        assert not Path(f"/proc/{pid}").exists(), "criu dump kills the process"
        assert dump_s > 0 and (tmp_path / "images" / "pstree.img").exists()
        before = _steps(out)
        restore_s = raw.restore(tmp_path / "images")
        assert restore_s > 0 and _comm(pid) == "counter"  # back with its own pid
        deadline = time.monotonic() + 10
        while _steps(out) <= before + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _steps(out) > before + 2, "the restored counter runs on"
    finally:
        kill(pid)


def test_bigmem_start_returns_its_own_pid(workloads: Path, tmp_path: Path) -> None:
    first = start_bigmem(tmp_path / "a.ready", mib=4, out=tmp_path / "a.out")
    second = start_bigmem(tmp_path / "b.ready", mib=4, out=tmp_path / "b.out")
    try:  # two of the same command line: each start names the one it started
        assert first != second
        assert _comm(first) == _comm(second) == "bigmem"
        assert Path(f"/proc/{first}/cmdline").read_bytes().split(b"\0")[-2] == \
            str(tmp_path / "a.ready").encode()
        assert Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")[-2] == \
            str(tmp_path / "b.ready").encode()
    finally:
        kill(first)
        kill(second)
