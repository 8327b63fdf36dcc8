"""The restore's output file is opened with the job owner's rights when the caller chose its
path (a user must not make root write where it cannot), and given to the owner when the daemon
chose it."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.stdio import LocalStdioProvider
from ckptd.domain import StdioFact, StdioKind
from ckptd.errors import InvalidTarget, PermissionDenied

NOBODY = (65534, 65534)
PIPE_OUT = (StdioFact(pid=1, fd=1, kind=StdioKind.PIPE, target="pipe:[1]",
                      external_key="pipe:[1]", writable=True),)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to act as another uid)")


def test_a_path_the_user_chose_in_a_root_only_directory_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    with pytest.raises(PermissionDenied, match="may not write there"), LocalStdioProvider(
    ).replacements(PIPE_OUT, secret / "x.out", NOBODY, chosen_by_caller=True):
        pass
    assert not (secret / "x.out").exists()


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="ckptd-stdio-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_path_the_user_chose_where_they_may_write_is_theirs(reachable: Path) -> None:
    mine = reachable / "mine"
    mine.mkdir()
    os.chown(mine, *NOBODY)
    with LocalStdioProvider().replacements(PIPE_OUT, mine / "x.out", NOBODY, True) as fds:
        assert len(fds) == 1
    st = (mine / "x.out").stat()
    assert (st.st_uid, st.st_gid) == NOBODY


def test_a_path_the_daemon_chose_is_given_to_the_owner(tmp_path: Path) -> None:
    with LocalStdioProvider().replacements(PIPE_OUT, tmp_path / "d" / "x.out", NOBODY, False):
        pass
    st = (tmp_path / "d" / "x.out").stat()
    assert (st.st_uid, st.st_gid) == NOBODY
    assert os.getuid() == 0 and os.geteuid() == 0


# ---- issue 14: a caller's --output never blocks a worker, never creates directories as root --


def test_a_fifo_without_a_reader_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(InvalidTarget, match="FIFO with no reader"), LocalStdioProvider(
    ).replacements(PIPE_OUT, fifo, (0, 0), chosen_by_caller=True):
        pass
    assert time.monotonic() - started < 2.0


def test_a_fifo_with_a_reader_is_taken_and_left_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with LocalStdioProvider().replacements(PIPE_OUT, fifo, (0, 0), True) as fds:
            assert not fcntl.fcntl(fds[0].fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(reader)


def test_a_missing_directory_is_not_created_for_the_caller(tmp_path: Path) -> None:
    target = tmp_path / "nonexistent" / "dir" / "x"
    with pytest.raises(InvalidTarget, match="does not exist"), LocalStdioProvider(
    ).replacements(PIPE_OUT, target, (0, 0), chosen_by_caller=True):
        pass
    assert not (tmp_path / "nonexistent").exists()


def test_a_socket_or_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidTarget, match="is a directory"), LocalStdioProvider(
    ).replacements(PIPE_OUT, tmp_path, (0, 0), chosen_by_caller=True):
        pass
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        with pytest.raises(InvalidTarget), LocalStdioProvider(
        ).replacements(PIPE_OUT, tmp_path / "sock", (0, 0), chosen_by_caller=True):
            pass
    finally:
        sock.close()


def test_an_open_that_hangs_fails_the_request_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung file system (stuck NFS): the open is given up after the timeout."""
    from ckptd.adapters.procfs import stdio

    real_open = stdio._open_output
    release = threading.Event()

    def stuck(path: Path) -> int:  # the open(2) of the output, stuck in the kernel
        if str(path).endswith("hung.out"):
            release.wait(10)
        return real_open(path)

    monkeypatch.setattr(stdio, "_open_output", stuck)
    started = time.monotonic()
    try:
        with pytest.raises(InvalidTarget, match=r"longer than 0\.3s"), LocalStdioProvider(
            open_timeout_s=0.3
        ).replacements(PIPE_OUT, tmp_path / "hung.out", (0, 0), chosen_by_caller=True):
            pass
    finally:
        release.set()
    assert time.monotonic() - started < 2.0
