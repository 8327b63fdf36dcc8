"""check-restore and the restore's compatibility check, on a real process and a real file.

A workload maps a small data file from a temp dir and runs on (``--leave-running``). Changing
that file makes ``check-restore`` list it as blocking and ``restore`` refuse with one line
naming it; putting it back (content and mtime) makes the checkpoint compatible again and the
restore works.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    assert_running,
    wait_state,
    wait_until,
)

pytestmark = pytest.mark.integration

SCRIPT = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
while True:
    time.sleep(0.05)
"""


def test_a_changed_data_file_blocks_the_restore_until_put_back(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    data = tmp_path / "tokenizer.json"
    original = b'{"vocab": ["a", "b", "c"]}\n'
    data.write_bytes(original)
    proc = procs.popen(
        [sys.executable, "-c", SCRIPT, str(data)], cwd=tmp_path,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    pid = proc.pid
    wait_until(lambda: str(data) in Path(f"/proc/{pid}/maps").read_text(), 10, "file mapped")
    ck = assert_ok(daemon.ctl("dump", pid, "--leave-running"), "dump --leave-running")
    assert ck["fingerprint"]["files"] >= 2  # the interpreter and the data file at least
    assert ck["fingerprint"]["arch"] == os.uname().machine
    stat = data.stat()

    same = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore")
    assert same == {"compatible": True, "blocking": [], "warnings": [], "notes": []}

    data.write_bytes(original.replace(b"a", b"z"))  # same size, other content
    res = daemon.ctl("check-restore", ck["id"])
    assert res.rc == 1, res.err
    assert res.out["compatible"] is False
    assert [b for b in res.out["blocking"] if str(data) in b] == [
        f"file {data} changed (mtime/content differs)"
    ], res.out

    proc.kill()
    proc.wait(timeout=10)
    wait_state(pid, [None])
    refused = daemon.ctl("restore", ck["id"])
    assert_one_line_error(refused, 2, str(data), "changed")

    data.write_bytes(original)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore after put back")
    assert again["compatible"] is True, again
    restored = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(restored["pid"])
    assert restored["pid"] == pid
    assert_running(pid, "after the restore")
