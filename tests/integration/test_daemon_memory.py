"""Issue 21 (11b): the daemon's resident memory stays bounded over many small dumps (glibc's
arenas capped, freed memory trimmed after each operation). Memory, not time: measured with
the daemon's VmRSS after the first dump and after the last. scripts/bench_rss.py measures the
same at length (README, operating)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.client import Daemon as Client
from ckptd.daemon.heap import ARENA_MAX

from .support import Daemon, Procs, workload

pytestmark = pytest.mark.integration

DUMPS = 40
GROWTH_MIB = 8.0
"""Allowed growth from the first dump to the last: today's main grew 18 to 45 MiB over 40 dumps
of this job on a 2-core machine (more arenas, more growth, on bigger ones); bounded, ~1 to 2."""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_rss_stays_bounded_over_many_small_dumps(daemon: Daemon, procs: Procs) -> None:
    job = procs.popen(
        workload("counter", "--steps", 0, "--interval-ms", 50, "--mem-mib", 16),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    readings = []
    with Client(str(daemon.socket)) as client:
        for _ in range(DUMPS):
            events = list(client.stub.Dump(pb.DumpRequest(pid=job.pid, leave_running=True),
                                           timeout=120))
            assert events and events[-1].WhichOneof("event") == "checkpoint"
            readings.append(rss_mib(daemon.pid))
    growth = readings[-1] - readings[0]
    shown = ", ".join(f"{r:.0f}" for r in readings)
    assert growth < GROWTH_MIB, f"RSS grew {growth:.1f} MiB over {DUMPS} dumps: {shown} MiB"
    # what keeps it so: one arena besides the main one (today's main: one per thread, 15
    # here), whatever thread ran each dump
    assert arenas(daemon.pid) <= ARENA_MAX - 1, f"{arenas(daemon.pid)} arenas besides main"


HEAP_MAX = 64 << 20
"""A glibc arena other than the main one: a 64 MiB-aligned mapping of 64 MiB (64-bit), its
used part rw-p and the rest ---p."""


def arenas(pid: int) -> int:
    """Arenas of ``pid`` besides the main one, from its mappings."""
    spans: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5:
            continue  # a file or a named region ([stack], [heap])
        start, end = (int(x, 16) for x in fields[0].split("-"))
        base = start - start % HEAP_MAX
        if base == start and fields[1] == "rw-p":
            spans[base] = end - start
        elif base in spans and fields[1] == "---p" and start == base + spans[base]:
            spans[base] += end - start
    return sum(1 for size in spans.values() if size == HEAP_MAX)
