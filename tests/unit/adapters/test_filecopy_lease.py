"""Issue 34 (6): a file the job holds a lease on is read through the job's own open file
description (``pidfd_getfd``), never opened again: an open breaks a write lease and waits the
kernel's lease-break time. Here the test process is the job: it takes the lease itself."""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import xxhash

from ckptd.adapters.criu.leases import holds_lease
from ckptd.adapters.procfs.filecopy import capture_file, precopy_file
from ckptd.core.ports import NotCaptured, WrittenFile

CONTENT = bytes(range(256)) * 64 + b"tail"


@pytest.fixture
def breaks() -> Iterator[list[int]]:
    """The SIGIO signals (lease breaks) this process is sent meanwhile."""
    sent: list[int] = []

    def note(signo: int, frame: FrameType | None) -> None:
        del frame
        sent.append(signo)

    before = signal.signal(signal.SIGIO, note)
    try:
        yield sent
    finally:
        signal.signal(signal.SIGIO, before)


def _leased(path: Path, flags: int) -> int:
    path.write_bytes(CONTENT)
    fd = os.open(path, flags | os.O_CLOEXEC)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    return fd


def _written(path: Path, fd: int) -> WrittenFile:
    return WrittenFile(str(path), len(CONTENT), f"/proc/{os.getpid()}/fd/{fd}", os.getpid())


def test_a_leased_file_is_copied_through_the_holders_description_keeping_lease_and_offset(
    tmp_path: Path, breaks: list[int]
) -> None:
    fd = _leased(tmp_path / "data", os.O_RDWR)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        assert holds_lease(os.getpid())
        early = precopy_file(_written(tmp_path / "data", fd), tmp_path / "pre")
        assert early is not None and early.size == len(CONTENT)
        captured = capture_file(_written(tmp_path / "data", fd), tmp_path / "img")
        assert captured is not None and captured.size == len(CONTENT)
        assert captured.hash == xxhash.xxh3_128(CONTENT).hexdigest()
        assert (tmp_path / "img").read_bytes()[: len(CONTENT)] == CONTENT
        assert (tmp_path / "pre").read_bytes() == CONTENT
        assert fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7  # the job's offset never moved
        assert breaks == []
    finally:
        os.close(fd)


def test_a_file_leased_through_a_write_only_descriptor_is_not_captured_and_keeps_its_lease(
    tmp_path: Path, breaks: list[int]
) -> None:
    fd = _leased(tmp_path / "data", os.O_WRONLY)
    try:
        assert precopy_file(_written(tmp_path / "data", fd), tmp_path / "pre") is None
        with pytest.raises(NotCaptured, match="write-only descriptor: reading it would break"):
            capture_file(_written(tmp_path / "data", fd), tmp_path / "img")
        assert fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK
        assert breaks == []
    finally:
        os.close(fd)


def test_a_file_without_a_lease_is_read_by_an_open_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "data").write_bytes(CONTENT)
    fd = os.open(tmp_path / "data", os.O_WRONLY | os.O_CLOEXEC)  # write-only: opened anew
    try:
        assert not holds_lease(os.getpid())
        captured = capture_file(_written(tmp_path / "data", fd), tmp_path / "img")
        assert captured is not None and captured.hash == xxhash.xxh3_128(CONTENT).hexdigest()
    finally:
        os.close(fd)
