"""The content-addressed store across checkpoints of one job: the second checkpoint stores only
what changed, yet each checkpoint restores on its own (also once the other is deleted and
garbage-collected); retention by name keeps the newest.

The job is ``bigmem --rewrite-pct 1``: each step rewrites 1% of its non-zero pages, so between
two checkpoints a small part of its memory changes, deterministically (the uninterrupted run
with ``--interval-ms 0`` is the reference for both restores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .flows import Job
from .store_support import kill_pid, manifest_refs, store_files
from .support import (
    Daemon,
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


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, workloads: Path) -> Iterator[Daemon]:
    """conftest's ``daemon``, with ``gc_grace_s`` 0: ``gc`` deletes unreferenced data at once
    (what it deletes is checked here; two-phase GC itself in tests/unit/store)."""
    del workloads
    # gc_interval_s 0: the tests' ckptctl gc is the only one (the daemon's own, after
    # --keep deletes, would race what they check)
    with running_daemon(tmp_path_factory.mktemp("ckptd"),
                        config={"gc_grace_s": 0.0, "gc_interval_s": 0.0}) as d:
        yield d


MIB = 64
STEPS = 40
INTERVAL = 50


def restore_and_check(
    d: Daemon, procs: Procs, ck: dict[str, Any], ref: list[str], low: int, high: int
) -> int:
    """Restore ``ck``, check its whole output against the reference, then make sure it is gone
    (it has exited after ``done``; killed if not) so that its pid is free again."""
    res = assert_ok(d.ctl("restore", ck["id"]), f"restore {ck['id']}")
    procs.add(res["pid"])
    assert res["id"] == ck["id"] and res["pid"] == ck["pid"]
    assert res["output_path"], "stdout was a pipe: the restore must name its output file"
    post = wait_for_done(Path(res["output_path"]), timeout=60)
    point = assert_continues_from_dump_point(post, ref, low, high)
    kill_pid(res["pid"])
    return point


def test_second_checkpoint_stores_only_the_changes_and_each_restores_alone(
    daemon: Daemon, procs: Procs
) -> None:
    cmd = workload("bigmem", "--mib", MIB, "--rewrite-pct", 1, "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    job = Job(procs, cmd)
    job.reader.read_lines(3, timeout=30)
    first, low1, high1 = job.dump_leave_running(daemon)
    job.reader.read_lines(high1 + 5)  # 5 steps: about 5% of the pages rewritten
    second, low2, high2 = job.dump_leave_running(daemon)
    assert high1 < low2, "the two checkpoints must be taken at different steps"
    lines = job.reader.read_lines(high2 + 2)
    assert not lines[-1].startswith("done"), "the job finished too early for the test"
    job.kill()

    print(
        f"first: bytes_new {first['bytes_new']} logical {first['bytes_logical']}; second: "
        f"bytes_new {second['bytes_new']} logical {second['bytes_logical']}"
    )
    assert second["parent_id"] == first["id"]
    assert first["bytes_new"] > MIB * (1 << 20) // 4, (
        f"the first checkpoint of a {MIB} MiB job added only {first['bytes_new']} bytes"
    )
    assert second["bytes_new"] < first["bytes_new"] // 4, (
        f"the second checkpoint added {second['bytes_new']} bytes, the first "
        f"{first['bytes_new']}: unchanged pages must not be stored again"
    )
    assert second["bytes_new"] > 0
    ratio = second["bytes_logical"] / first["bytes_logical"]
    assert 0.9 < ratio < 1.1, (
        f"bytes_logical {first['bytes_logical']} then {second['bytes_logical']}: the same job"
    )

    point1 = restore_and_check(daemon, procs, first, ref, low1, high1)
    point2 = restore_and_check(daemon, procs, second, ref, low2, high2)
    assert point1 < point2

    # Without the first, the second must still restore: its page list may be a delta of the
    # first's, its pages may live in packs the first wrote.
    first_packs, first_blobs = manifest_refs(daemon.store, first["id"])
    second_packs, second_blobs = manifest_refs(daemon.store, second["id"])
    assert_ok(daemon.ctl("delete", first["id"]), "delete")
    assert [c["id"] for c in daemon.checkpoints_of(job.pid)] == [second["id"]]
    gc = assert_ok(daemon.ctl("gc"), "gc")
    assert gc["deleted_checkpoints"] == []
    packs = {p.name for p in store_files(daemon.store, "packs")}
    blobs = {p.name for p in store_files(daemon.store, "blobs")}
    assert second_packs <= packs and second_blobs <= blobs, "gc deleted what the second needs"
    assert not (first_packs - second_packs) & packs, "what only the first needed is left"
    assert not (first_blobs - second_blobs) & blobs, "what only the first needed is left"
    rc, out, err = daemon.ctl("show", first["id"])
    assert rc != 0 and first["id"] in err, f"show of a deleted checkpoint: {rc} {out!r} {err!r}"
    report = assert_ok(daemon.ctl("verify", second["id"]), "verify")
    assert report["ok"] is True and report["problems"] == [], report
    report = assert_ok(daemon.ctl("verify"), "verify")
    assert report["ok"] is True and report["problems"] == [], report
    assert second["id"] in report["checked"] and first["id"] not in report["checked"]
    assert report["packs_checked"] == len(store_files(daemon.store, "packs"))
    assert restore_and_check(daemon, procs, second, ref, low2, high2) == point2


def test_retention_by_name_keeps_the_newest(daemon: Daemon, procs: Procs) -> None:
    job = Job(procs, workload("counter", "--steps", 0, "--mem-mib", 2))
    job.reader.read_lines(2)
    ids = []
    for _ in range(3):
        job.reader.read_lines(len(job.reader.lines) + 1)
        ck, _, _ = job.dump_leave_running(daemon, "--name", "inc-keep", "--keep", 2)
        assert ck["name"] == "inc-keep"
        ids.append(ck["id"])
    listed = assert_ok(daemon.ctl("list", "--name", "inc-keep"), "list --name")
    assert [c["id"] for c in listed] == ids[1:], "the 2 newest, oldest first"
    assert [c["id"] for c in daemon.checkpoints_of(job.pid)] == ids[1:]
    rc, _, err = daemon.ctl("show", ids[0])
    assert rc != 0 and ids[0] in err, "the oldest checkpoint must be deleted"
    job.kill()
    for cid in ids[1:]:
        report = assert_ok(daemon.ctl("verify", cid), "verify")
        assert report["ok"] is True, report
