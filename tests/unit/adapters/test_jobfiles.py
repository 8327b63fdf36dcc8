"""``ProcJobFiles`` on real processes: what counts as a written file, reads through the
process's own descriptor, and puts back with the owner's rights."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.core.ports import PutBack, WrittenFile
from ckptd.domain import CapturedFile, ProcessFact

WRITER = """
import ctypes, mmap, os, sys, time
ro = open(sys.argv[1], "rb")                       # read only: not written
rw = open(sys.argv[2], "r+b")                      # read-write
gone = open(sys.argv[3], "wb"); os.unlink(sys.argv[3])  # deleted: CRIU keeps it itself
null = open("/dev/null", "wb")                     # a device
fd = os.open(sys.argv[4], os.O_RDWR)               # mapped shared and writable, no fd
libc = ctypes.CDLL(None); libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
assert libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0) != -1
os.close(fd)
print("ok", flush=True)
time.sleep(60)
"""


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[tuple[tuple[ProcessFact, ...], Path]]:
    for name in ("ro", "rw", "gone", "mapped"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, *(str(tmp_path / n) for n in ("ro", "rw", "gone",
                                                                        "mapped"))],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
        yield ProcFsTable().tree(proc.pid), tmp_path
    finally:
        proc.kill()
        proc.wait()


def test_written_files_are_those_open_for_writing_or_mapped_shared(
    writer: tuple[tuple[ProcessFact, ...], Path],
) -> None:
    tree, tmp = writer
    written = ProcJobFiles().written(tree)
    assert [w.path for w in written] == [str(tmp / "mapped"), str(tmp / "rw")]
    assert [w.append_only for w in written] == [False, False]  # mapped; opened r+b
    mapped = written[0]
    assert "/map_files/" in mapped.source


def test_capture_reads_through_the_process_not_the_path(
    writer: tuple[tuple[ProcessFact, ...], Path],
) -> None:
    tree, tmp = writer
    files = ProcJobFiles()
    rw = next(w for w in files.written(tree) if w.path.endswith("/rw"))
    secret = tmp / "secret"
    secret.write_bytes(b"not the job's")
    os.rename(tmp / "rw", tmp / "rw.moved")
    os.symlink(secret, tmp / "rw")  # the path now leads elsewhere
    captured = files.capture(rw, tmp / "img")
    assert captured is not None and captured.size == 4096
    assert (tmp / "img").read_bytes() == b"x" * 4096


def test_a_file_gone_since_it_was_listed_is_not_captured(tmp_path: Path) -> None:
    gone = WrittenFile(str(tmp_path / "x"), 1, "/proc/self/fd/987654", os.getpid())
    assert ProcJobFiles().capture(gone, tmp_path / "img") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_put_back_acts_with_the_owners_rights_and_never_follows_a_symlink(tmp_path: Path) -> None:
    files = ProcJobFiles()
    (tmp_path / "content").write_bytes(b"captured")
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    target = root_only / "f"
    captured = CapturedFile(str(target), 8, 0o644, 65534, 65534, "h", "content")
    assert files.check(captured, 65534, 65534).problem  # nobody cannot even look there
    with pytest.raises(PermissionError):
        files.put_back(captured, tmp_path / "content", str(target) + ".aside", 65534, 65534,
                       _ignore)
    assert not target.exists()
    # a symlink where the file was is never written through (not even by root)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "link"
    link.symlink_to(victim)
    linked = CapturedFile(str(link), 8, 0o644, 0, 0, "h", "content")
    assert files.check(linked, 0, 0).problem == "it is no longer a regular file"
    with pytest.raises(OSError):
        files.put_back(linked, tmp_path / "content", str(link) + ".aside", 0, 0, _ignore)
    assert victim.read_bytes() == b"precious"


def _ignore(done: PutBack) -> None:
    pass
