"""``sharers.writers_of`` over a /proc laid out by the test: a file's other writers found by
identity through descriptors open for writing and shared writable mappings, never through
one open for reading, a private mapping or another file at the same path; their commands
made printable."""

from __future__ import annotations

import os
from pathlib import Path

from ckptd.adapters.procfs.sharers import writers_of


def _process(proc: Path, pid: int, comm: str) -> Path:
    base = proc / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "fdinfo").mkdir()
    (base / "map_files").mkdir()
    (base / "comm").write_text(comm + "\n")
    (base / "maps").write_text("")
    return base


def _fd(base: Path, fd: int, target: Path, flags: int) -> None:
    (base / "fd" / str(fd)).symlink_to(target)
    (base / "fdinfo" / str(fd)).write_text(f"pos:\t0\nflags:\t{flags:o}\nmnt_id:\t1\n")


def _map(base: Path, target: Path, perms: str) -> None:
    span = "7f0000000000-7f0000001000"
    (base / "map_files" / span).symlink_to(target)
    (base / "maps").write_text(f"{span} {perms} 00000000 08:01 {target.stat().st_ino}"
                               f"          {target}\n")


def test_writers_by_identity_through_fds_and_shared_mappings(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    log, db, other = tmp_path / "job.log", tmp_path / "history.sqlite", tmp_path / "x"
    for path in (log, db, other):
        path.write_bytes(b"1")
    st_log, st_db = log.stat(), db.stat()
    wanted = {(st_log.st_dev, st_log.st_ino): str(log), (st_db.st_dev, st_db.st_ino): str(db)}

    _fd(_process(proc, 10, "job"), 3, log, os.O_WRONLY | os.O_APPEND)  # the tree's own
    _fd(_process(proc, 20, "logger"), 5, log, os.O_WRONLY | os.O_APPEND)
    _fd(_process(proc, 30, "reader"), 4, log, os.O_RDONLY)  # reads only: no writer
    _map(_process(proc, 40, "kernel"), db, "rw-s")
    _map(_process(proc, 50, "private"), db, "rw-p")  # copy-on-write: writes nothing back
    _fd(_process(proc, 60, "evil\x1b]0;x\x07"), 7, db, os.O_RDWR)
    _fd(_process(proc, 70, "unrelated"), 3, other, os.O_RDWR)
    (proc / "70" / "fd" / "4").symlink_to("socket:[1234]")

    found = writers_of(proc, wanted, outside={10})
    assert found == {str(log): [(20, "logger")],
                     str(db): [(40, "kernel"), (60, "evil?]0;x?")]}
    assert writers_of(proc, {}, outside=()) == {}
