"""GC compacts the packs of a job that rewrites scattered memory (issue 24, point 4): with
``--keep 2`` the store no longer only grows — the pack of the first (full) checkpoint, pinned
by the pages the kept checkpoints still share with it, is rewritten and freed — and the kept
checkpoints still verify and restore, bit for bit.

The job is ``bigmem --rewrite-pct 10``: each step rewrites 10% of its non-zero pages (random
ones), so most of the first checkpoint's pack is dead after a few steps while some of its
pages live on in every later checkpoint.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .flows import Job as _Job
from .store_support import kill_pid, largest_pack, store_files
from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continues_from_dump_point,
    assert_ok,
    reference,
    running_daemon,
    wait_for_done,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

MIB = 32
STEPS = 800
INTERVAL = 20
DUMPS = 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, workloads: Path) -> Iterator[Daemon]:
    """conftest's ``daemon``, with ``gc_grace_s`` 0: ``gc`` deletes at once what compaction
    left unreferenced (two-phase GC itself: tests/unit/store); ``gc_interval_s`` 0: the
    test's ``ckptctl gc`` is the only one (the daemon's own, after ``--keep`` deletes, would
    race it and leave it nothing to report)."""
    del workloads
    with running_daemon(tmp_path_factory.mktemp("ckptd"),
                        config={"gc_grace_s": 0.0, "gc_interval_s": 0.0}) as d:
        yield d


class Job(_Job):
    """test_store_incremental's job, stepping every INTERVAL ms: it outlives the dumps (on a
    busy machine too), and a restore runs to its end in seconds."""

    def __init__(self, procs: Procs, cmd: list[str]) -> None:
        self.proc = procs.popen(
            with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid


def _pack_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store_files(store, "packs"))


def test_gc_rewrites_packs_a_few_live_pages_pin(daemon: Daemon, procs: Procs) -> None:
    cmd = workload("bigmem", "--mib", MIB, "--rewrite-pct", 10, "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    job = Job(procs, cmd)
    job.reader.read_lines(2)
    dumps = []
    for _ in range(DUMPS):
        job.reader.read_lines(len(job.reader.lines) + 3)  # a few rewrite steps
        dumps.append(job.dump_leave_running(daemon, "--name", "churn", "--keep", 2))
    job.kill()
    store = daemon.store
    first_pack = largest_pack(store)  # the first checkpoint's: every page of the job
    kept = [c["id"] for c in assert_ok(daemon.ctl("list", "--name", "churn"), "list")]
    assert kept == [ck["id"] for ck, _, _ in dumps[-2:]]
    newest = dumps[-1][0]
    before = _pack_bytes(store)

    t0 = time.monotonic()
    report = assert_ok(daemon.ctl("gc"), "gc")
    took = time.monotonic() - t0
    after = _pack_bytes(store)
    print(f"packs {before} -> {after} bytes; gc {took:.2f}s; {report}")
    assert int(report["bytes_freed"]) > 0, report
    assert int(report["packs_rewritten"]) >= 1 and int(report["packs_written"]) >= 1, report
    assert sorted(p["checkpoint_id"] for p in report["pinned"]) == sorted(kept), report
    assert sum(int(p["bytes_alone"]) for p in report["pinned"]) <= after
    assert not first_pack.exists(), "the first checkpoint's pack is still pinned"
    # what the two kept checkpoints hold: the newest one, plus the pages it changed since
    # the other one (about as many as the other holds and the newest does not)
    unique = int(newest["bytes"]) + int(newest["bytes_new"])
    assert after <= 1.5 * unique, (after, unique)

    for cid in kept:
        assert assert_ok(daemon.ctl("verify", cid), "verify")["ok"] is True
    ck, low, high = dumps[-1]
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    post = wait_for_done(Path(res["output_path"]), timeout=90)
    assert_continues_from_dump_point(post, ref, low, high)
    kill_pid(res["pid"])
