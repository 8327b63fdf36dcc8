"""A full store can be cleaned (issue 33, point 3): the store on a filesystem of its own (a
64 MiB tmpfs), filled to the last byte by a file beside the store's objects; a deleted
checkpoint's pack is freed by ``ckptctl gc --no-compact``, and by ``ckptctl gc`` too, whose
compaction (it would write new packs first) is skipped with one line in the report; nothing
it began is left behind. Once there is room again, ``gc`` compacts, and the kept checkpoints
verify and restore bit for bit.

Before the fix, ``gc`` on a full store failed with ENOSPC every time (compaction ran first
and aborted the run), and there was no ``--no-compact``.

No race with the daemon's own cleanup: its start-up cleanup ends before it serves (the
daemon fixture waits for that), and ``gc_interval_s`` 0 leaves ``ckptctl gc`` the only GC.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .flows import Job as _Job
from .store_support import kill_pid, manifest_refs, store_files, temporaries
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

STORE_MIB = 64
MIB = 16
STEPS = 800
INTERVAL = 20
DUMPS = 5
SKIPPED = re.compile(
    r"compaction skipped: the store's filesystem is full \(No space left on device\); "
    r"freed (\d+) bytes first; run gc again once there is room"
)


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory, workloads: Path) -> Iterator[Daemon]:
    """A daemon whose store is a tmpfs of STORE_MIB MiB; ``gc_grace_s`` 0 (one daemon on its
    store: gc deletes at once what no checkpoint needs), no periodic GC."""
    del workloads
    root = tmp_path_factory.mktemp("ckptd")
    store = root / "store"
    store.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_MIB}m,mode=0700",
                    "ckptd-full-store", str(store)], check=True)
    try:
        with running_daemon(root, config={"gc_grace_s": 0.0, "gc_interval_s": 0.0}) as d:
            yield d
    finally:
        subprocess.run(["umount", str(store)], check=True)


class Job(_Job):
    """A job on a pipe, stepping every INTERVAL ms (it outlives the dumps)."""

    def __init__(self, procs: Procs, cmd: list[str]) -> None:
        self.proc = procs.popen(
            with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid


def _fill(store: Path) -> None:
    """Take every free byte of the store's filesystem (a file beside its objects, grown),
    and check that not one more byte can be written there."""
    free = os.statvfs(store).f_bavail * os.statvfs(store).f_frsize
    fd = os.open(store / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if free:
            os.posix_fallocate(fd, os.fstat(fd).st_size, free)
    finally:
        os.close(fd)
    probe = os.open(store / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as exc:
            os.write(probe, b"x")
        assert exc.value.errno == errno.ENOSPC
    finally:
        os.close(probe)
        os.unlink(store / "probe")


def _pack_of_its_own(store: Path, checkpoint_id: str) -> Path:
    """The one pack that holds what ``checkpoint_id`` stored new (dumped last: no other
    checkpoint names it)."""
    packs, _blobs = manifest_refs(store, checkpoint_id)
    return max((p for p in store_files(store, "packs") if p.name in packs),
               key=lambda p: p.stat().st_mtime)


def _small_checkpoint(daemon: Daemon, procs: Procs) -> tuple[str, Path]:
    """A small job (``counter``) dumped, then killed: (its checkpoint, its own pack)."""
    job = Job(procs, workload("counter", "--steps", STEPS))
    job.reader.read_lines(2)
    ck, _, _ = job.dump_leave_running(daemon)
    job.kill()
    return ck["id"], _pack_of_its_own(daemon.store, ck["id"])


def _objects(store: Path) -> set[Path]:
    return {p for p in store.rglob("*") if p.is_file() and p.name != "filler"}


def test_a_full_store_frees_what_needs_no_space_and_compacts_once_there_is_room(
    daemon: Daemon, procs: Procs
) -> None:
    store = daemon.store
    cmd = workload("bigmem", "--mib", MIB, "--rewrite-pct", 10, "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    job = Job(procs, cmd)
    job.reader.read_lines(2)
    dumps = []
    for _ in range(DUMPS):  # the first pack ends up pinned by a few live pages: compactable
        job.reader.read_lines(len(job.reader.lines) + 3)
        dumps.append(job.dump_leave_running(daemon, "--name", "churn", "--keep", 2))
    job.kill()
    kept = [ck["id"] for ck, _, _ in dumps[-2:]]
    # dumped last, newest first deleted: neither pack is named by a checkpoint kept
    second, second_pack = _small_checkpoint(daemon, procs)
    first, first_pack = _small_checkpoint(daemon, procs)
    assert first_pack != second_pack

    # --no-compact on a full store: the dead pack freed, not one object written
    assert_ok(daemon.ctl("delete", first), "delete")
    _fill(store)
    before = _objects(store)
    size = first_pack.stat().st_size
    report = assert_ok(daemon.ctl("gc", "--no-compact"), "gc --no-compact")
    print(f"gc --no-compact: {report}")
    assert not first_pack.exists(), report
    assert int(report["bytes_freed"]) >= size, report
    assert int(report.get("packs_rewritten", 0)) == 0 and not report.get("skipped"), report
    assert _objects(store) <= before

    # gc on a full store: the dead pack freed first, compaction skipped in one line
    assert_ok(daemon.ctl("delete", second), "delete")
    _fill(store)
    before = _objects(store)
    size = second_pack.stat().st_size
    report = assert_ok(daemon.ctl("gc"), "gc")
    print(f"gc on a full store: {report}")
    assert not second_pack.exists(), report
    (line,) = report["skipped"]
    found = SKIPPED.fullmatch(line)
    assert found, line
    assert int(found[1]) >= size and int(report["bytes_freed"]) >= int(found[1]), report
    assert int(report.get("packs_rewritten", 0)) == 0, report
    # what compaction began is gone: no new pack, no lease, no temporary
    assert _objects(store) <= before, sorted(map(str, _objects(store) - before))
    assert not temporaries(store)
    for cid in kept:
        assert assert_ok(daemon.ctl("verify", cid), "verify")["ok"] is True

    # room again: gc compacts
    (store / "filler").unlink()
    report = assert_ok(daemon.ctl("gc"), "gc")
    print(f"gc with room: {report}")
    assert not report.get("skipped") and int(report["packs_rewritten"]) >= 1, report
    for cid in kept:
        assert assert_ok(daemon.ctl("verify", cid), "verify")["ok"] is True
    ck, low, high = dumps[-1]
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    post = wait_for_done(Path(res["output_path"]), timeout=90)
    assert_continues_from_dump_point(post, ref, low, high)
    kill_pid(res["pid"])
