"""Issue 34 (8), for real: SQLite in WAL mode holds a POSIX read lock on byte 128 of the
``-shm`` file it maps (the lock that tells another connection it is not alone); CRIU's
restore drops a process's POSIX locks on a file it maps, so the restored connection comes
back without it, and another process may then reset the ``-shm`` under it. The dump says so,
naming the file and the lock (``ckptctl show``: a file not captured); the lock on the
database file itself, which the job does not map, is restored and not named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.transport.cli import render

from .support import Daemon, Procs, assert_ok, wait_until

pytestmark = pytest.mark.integration

JOB = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("pragma journal_mode=wal")
db.execute("create table if not exists t(x)")
db.execute("insert into t values (1)")
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _posix_locks(pid: int) -> dict[int, str]:
    """inode -> the byte range of each POSIX lock ``pid`` holds (/proc/locks)."""
    found = {}
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "POSIX" and fields[4] == str(pid):
            found[int(fields[5].rsplit(":", 1)[1])] = f"{fields[6]}-{fields[7]}"
    return found


def test_a_sqlite_wal_lock_the_restore_drops_is_named_at_dump(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    db = tmp_path / "job.sqlite"
    shm = Path(f"{db}-shm")
    job = procs.popen([sys.executable, "-c", JOB, str(db)], stdin=subprocess.DEVNULL,
                      stdout=subprocess.PIPE)
    assert job.stdout is not None and job.stdout.readline() == b"ready\n"
    before = _posix_locks(job.pid)
    assert before.get(shm.stat().st_ino) == "128-128", before  # SQLite's lock on the -shm
    assert db.stat().st_ino in before

    ck = assert_ok(daemon.ctl("dump", job.pid), "dump")
    assert job.wait(timeout=10) != 0
    [lost] = [s for s in ck["files_skipped"] if "lock" in s]
    assert lost.startswith(f"{shm}: the POSIX read lock pid {job.pid} holds on bytes 128-128 "
                           "is not restored"), lost
    shown = assert_ok(daemon.ctl("show", ck["id"]), "show")
    assert lost in shown["files_skipped"]
    said = f"file not captured: {lost}"  # ckptctl dump's and show's text
    assert said in render.dump_summary(ck).splitlines()
    assert said in render.checkpoint_details(shown).splitlines()

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: db.stat().st_ino in _posix_locks(res["pid"]), 10,
               "the database file's lock back")
    after = _posix_locks(res["pid"])
    assert shm.stat().st_ino not in after, after  # what the dump said: CRIU drops it
