"""Issue 33.1: CRIU reopens a restored job's objects by path, as root — after ckptd checked them.

A real unprivileged user owns a directory on the path of what a root job holds (a file it
reads, a file it appends to, its working directory, a file it maps, a FIFO). At the restore,
as soon as ``/proc/PID`` of the restored task appears (CRIU has forked it and has not opened
its files yet), the user exchanges (``renameat2(RENAME_EXCHANGE)``) the job's directory for a
symbolic link to a root-only directory holding objects of the same names. Without ckptd's
check the restored job gets the root-only objects (the issue: 3 restores of 3); with it the
restore is undone before the job runs, in one line naming the object, the root-only objects
are untouched, and once the directory is back the job restores and continues bit for bit.
Also: a deleted-but-open file (its ghost file, or the link-remap file of one still linked
elsewhere), a bound unix socket in such a directory: the restore is refused before CRIU runs
(CRIU would create or remove their files there by path, as root).
Real CRIU, the real daemon and CLI.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .support import Daemon, Procs, assert_ok, assert_one_line_error, wait_until
from .test_root_paths import area, as_user, attacker, user_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

JOB = r"""
import mmap, os, socket, sys, time
kind, data, log = sys.argv[1], sys.argv[2], sys.argv[3]
held = []
out = open(log, "ab", buffering=0)
if kind == "read":
    held.append(open(os.path.join(data, "obj"), "rb"))
elif kind == "append":
    held.append(open(os.path.join(data, "obj"), "ab", buffering=0))
elif kind == "cwd":
    os.chdir(data)
elif kind == "map":
    with open(os.path.join(data, "obj"), "rb") as f:
        held.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
elif kind == "fifo":
    held.append(os.open(os.path.join(data, "obj"), os.O_RDWR))
elif kind == "root":
    os.chroot(data)
elif kind == "linked":
    held.append(open(os.path.join(data, "obj"), "rb"))
    os.link(os.path.join(data, "obj"), os.path.join(data, "kept"))
    os.unlink(os.path.join(data, "obj"))
elif kind == "ghost":
    f = open(os.path.join(data, "obj"), "w+b"); f.write(b"gone\n" * 100); f.flush()
    os.unlink(os.path.join(data, "obj")); held.append(f)
elif kind == "socket":
    s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(data, "obj")); s.listen(1)
    held.append(s)
for i in range(100000):
    out.write(b"step %d\n" % i)
    time.sleep(0.02)
"""

SWAP = r"""
import ctypes, os, sys
pid, a, b = int(sys.argv[1]), sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
while not os.path.exists(f"/proc/{pid}"):
    pass
if libc.renameat2(-100, a.encode(), -100, b.encode(), 2) != 0:  # RENAME_EXCHANGE
    sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""


def _objects(where: Path, kind: str, content: bytes) -> None:
    where.mkdir(mode=0o755)
    obj = where / "obj"
    if kind == "fifo":
        os.mkfifo(obj, 0o600)
    elif kind in ("read", "append", "map"):
        obj.write_bytes(content)
        obj.chmod(0o600)


def _steps(log: Path) -> list[bytes]:
    return log.read_bytes().splitlines()


def _assert_continues(log: Path) -> None:
    """The log is exactly step 0, 1, ... with no step lost or repeated: the job continued
    from its checkpoint as an uninterrupted run would."""
    got = _steps(log)
    assert got == [b"step %d" % i for i in range(len(got))], got[-5:]


@pytest.mark.parametrize("kind", ["read", "append", "cwd", "root", "map", "fifo"])
def test_a_directory_swapped_while_criu_reopens_is_undone_before_the_job_runs(
    daemon: Daemon, procs: Procs, area: Path, attacker: int, kind: str, tmp_path: Path,  # noqa: F811
) -> None:
    home = user_dir(area, attacker)
    data = home / "data"  # root's, in the attacker's directory: it can be exchanged
    _objects(data, kind, b"the job's own bytes\n")
    private = area / "private"
    private.mkdir(mode=0o700)
    vault = private / "vault"  # root-only (in a 0700 directory), objects of the same names
    _objects(vault, kind, b"root's secret bytes\n")
    before = {p.name: (p.lstat().st_ino, p.lstat().st_mode) for p in vault.iterdir()}
    secret_bytes = (vault / "obj").read_bytes() if kind in ("read", "append", "map") else b""
    log = tmp_path / "job.log"
    job = procs.popen([sys.executable, "-c", JOB, kind, str(data), str(log)],
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    wait_until(lambda: log.exists() and len(_steps(log)) >= 3, 30, "the job's first steps")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=10)
    as_user(attacker, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", vault,
            home / "swap")

    swapper = as_user(attacker, SWAP, job.pid, data, home / "swap", wait=False)
    res = daemon.ctl("restore", ck["id"])
    assert swapper.wait(timeout=60) == 0, "the swap did not happen"
    if res.rc == 0:
        procs.add(res.out["pid"])
    assert_one_line_error(res, res.rc, "not what the checkpoint names")
    assert "vault" in res.err, res.err
    assert os.path.islink(data), "the directory was not swapped during the restore"
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{job.pid}") or \
        Path(f"/proc/{job.pid}/status").read_text().find("State:\tZ") >= 0, "the job runs"
    after = {p.name: (p.lstat().st_ino, p.lstat().st_mode) for p in vault.iterdir()}
    assert after == before
    if secret_bytes:
        assert (vault / "obj").read_bytes() == secret_bytes
        assert stat.S_IMODE((vault / "obj").stat().st_mode) == 0o600

    # the directory back as it was: the same checkpoint restores and the job goes on exactly
    as_user(attacker, SWAP, 1, home / "swap", data)
    assert not os.path.islink(data)
    n = len(_steps(log))
    res = daemon.ctl("restore", ck["id"])
    assert_ok(res, "restore once the directory is back")
    procs.add(res.out["pid"])
    wait_until(lambda: len(_steps(log)) >= n + 5, 30, "steps after the restore")
    os.kill(res.out["pid"], signal.SIGKILL)
    _assert_continues(log)


@pytest.mark.parametrize(("kind", "what"), [("ghost", "ghost file"), ("socket", "unix socket")])
def test_criu_never_creates_files_where_a_user_can_redirect_it(
    daemon: Daemon, procs: Procs, area: Path, attacker: int, kind: str, what: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    home = user_dir(area, attacker)
    data = home / "data"
    data.mkdir()
    if kind == "linked":
        (data / "obj").write_bytes(b"linked elsewhere\n")
    log = tmp_path / "job.log"
    job = procs.popen([sys.executable, "-c", JOB, kind, str(data), str(log)],
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    wait_until(lambda: log.exists() and len(_steps(log)) >= 3, 30, "the job's first steps")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=10)
    if kind == "socket":
        (data / "obj").unlink()  # the socket's file: left by the killed job
    listed = sorted(p.name for p in data.iterdir())

    res = daemon.ctl("restore", ck["id"])
    if res.rc == 0:
        procs.add(res.out["pid"])
    assert_one_line_error(res, res.rc, f"CRIU would create or remove the {what}")
    assert f"owned by uid {attacker}" in res.err, res.err
    assert sorted(p.name for p in data.iterdir()) == listed, "CRIU created something there"
    assert not os.path.exists(f"/proc/{job.pid}")
    assert daemon.ctl("show", ck["id"]).rc == 0, "the checkpoint was not kept"


def test_criu_never_links_a_deleted_file_back_where_a_user_can_redirect_it(
    daemon: Daemon, procs: Procs, area: Path, attacker: int, tmp_path: Path,  # noqa: F811
) -> None:
    """A deleted file still linked elsewhere: CRIU's dump would link it back as
    ``link_remap.N`` beside its old path, by path, as root (and its restore open and remove
    it there). In a directory a user can change that is refused before anything freezes."""
    home = user_dir(area, attacker)
    data = home / "data"
    data.mkdir()
    (data / "obj").write_bytes(b"linked elsewhere\n")
    log = tmp_path / "job.log"
    job = procs.popen([sys.executable, "-c", JOB, "linked", str(data), str(log)],
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    wait_until(lambda: log.exists() and len(_steps(log)) >= 3, 30, "the job's first steps")
    res = daemon.ctl("dump", job.pid, "--leave-running")
    assert_one_line_error(res, res.rc, "deleted, still linked elsewhere",
                          "CRIU would create or remove the link-remap file",
                          f"owned by uid {attacker}")
    assert sorted(p.name for p in data.iterdir()) == ["kept"], "CRIU linked something there"
    n = len(_steps(log))
    wait_until(lambda: len(_steps(log)) >= n + 3, 30, "the job running on")
    _assert_continues(log)
