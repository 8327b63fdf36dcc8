"""The daemon's state directory at start: tightened to 0700 whatever it was, refused in one
line (exit 2, nothing served) when it is a symlink or read-only."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .support import CKPTD, Daemon, Procs, assert_one_line_error, assert_running, workload

pytestmark = pytest.mark.integration


def start_refused(root: Path, state_dir: Path) -> str:
    """Run ckptd on ``state_dir``; assert it exits 2 at once; its one stderr line."""
    proc = subprocess.run(
        [str(CKPTD), "--socket", str(root / "run" / "ckptd.sock"), "--store",
         str(root / "store"), "--state-dir", str(state_dir), "--jobs-cgroup", ""],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ckptd:")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_state_dir_that_existed_0755_is_made_0700(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    start_daemon("--state-dir", str(state))  # given last: wins over the helper's own
    assert oct(state.stat().st_mode & 0o777) == oct(0o700)
    assert (state / "ckptd.lock").exists()


def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "state"
    link.symlink_to(real)
    line = start_refused(tmp_path, link)
    assert str(link) in line and "symlink" in line and "--state-dir" in line
    assert not (real / "ckptd.lock").exists()


@contextlib.contextmanager
def read_only_mount(where: Path) -> Iterator[None]:
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("sub", ["", "state"], ids=["itself", "below"])
def test_a_read_only_state_dir_is_one_clear_line(tmp_path: Path, sub: str) -> None:
    ro = tmp_path / "ro"
    with read_only_mount(ro):
        state = ro / sub if sub else ro
        line = start_refused(tmp_path, state)
    assert str(state) in line, line
    assert "not writable" in line and "make it writable" in line and "--state-dir" in line, line
    assert "Errno" not in line and "internal error" not in line, line
    assert os.path.isdir(ro)


def test_a_state_dir_gone_read_only_under_a_running_daemon_is_one_clear_line(
    tmp_path: Path, start_daemon: Callable[..., Daemon], procs: Procs
) -> None:
    """Its work directory (where a dump's images go first) made read-only while it runs."""
    d = start_daemon()
    job = procs.popen(workload("counter", "--steps", 0, "--interval-ms", 50),
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True)
    work = d.state_dir / "work"
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(work)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.strip()}")
    try:
        res = d.ctl("dump", "--leave-running", job.pid)
    finally:
        subprocess.run(["umount", str(work)], check=False)
    line = assert_one_line_error(res, 1, f"cannot write in {work}", "read-only",
                                 "make it writable", "--state-dir")
    assert "Errno" not in line and "internal error" not in line, line
    assert_running(job.pid, "after a dump refused by a read-only state dir")


def test_a_state_dir_gone_full_under_a_running_daemon_is_one_clear_line(
    start_daemon: Callable[..., Daemon], procs: Procs
) -> None:
    """Issue 33 (7): its work directory full (a tmpfs with no inode left) while it runs: a
    dump says where and what to do, not `internal error: [Errno 28] ...`."""
    d = start_daemon()
    job = procs.popen(workload("counter", "--steps", 0, "--interval-ms", 50),
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True)
    work = d.state_dir / "work"
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=1", "tmpfs",
                           str(work)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        res = d.ctl("dump", "--leave-running", job.pid)
    finally:
        subprocess.run(["umount", str(work)], check=False)
    line = assert_one_line_error(res, 1, f"cannot write in {work}", "file system is full",
                                 "free space there", "--state-dir")
    assert "Errno" not in line and "internal error" not in line, line
    assert_running(job.pid, "after a dump refused by a full state dir")
