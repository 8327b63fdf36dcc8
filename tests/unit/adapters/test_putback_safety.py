"""The put-back's fd-relative rules on real files (``adapters.procfs.putback``/``safefs``):
what root refuses, what an undo acts on, what a crash leaves, and sparse files by extent."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash

from ckptd.adapters.procfs.filecopy import capture_file
from ckptd.adapters.procfs.putback import check_file, put_back, undo_put_back
from ckptd.adapters.procfs.safefs import Root, UnsafePath
from ckptd.core.ports import PutBack, WrittenFile
from ckptd.domain import CapturedFile


def _capture(path: Path, image: Path) -> CapturedFile:
    root = Root.node()
    try:
        with root.locate(str(path)) as loc:
            dirs = loc.chain
    finally:
        root.close()
    captured = capture_file(WrittenFile(str(path), path.stat().st_size, str(path), os.getpid()),
                            image, dirs=dirs, boot="")
    assert captured is not None
    return captured


def _put(captured: CapturedFile, image: Path, aside: str) -> tuple[PutBack | None,
                                                                   list[PutBack]]:
    journal: list[PutBack] = []
    root = Root.node()
    try:
        return put_back(root, captured, image, aside, journal.append), journal
    finally:
        root.close()


def _undo(done: PutBack) -> None:
    root = Root.node()
    try:
        undo_put_back(root, done)
    finally:
        root.close()


def test_undo_of_a_created_file_never_unlinks_through_a_swapped_directory(tmp_path: Path) -> None:
    """Point 3: the restore created ``d/job.log``; the directory is then swapped for a link
    to a root-only directory holding a file of that name; the undo must not delete it."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "job.log").write_bytes(b"abc")
    captured = _capture(d / "job.log", tmp_path / "img")
    (d / "job.log").unlink()
    done, _ = _put(captured, tmp_path / "img", str(d / "job.log.ckptd-r1"))
    assert done is not None and done.created
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    (vault / "job.log").write_bytes(b"root's")
    d.rename(tmp_path / "d.old")
    d.symlink_to(vault)
    with pytest.raises(UnsafePath, match="symbolic link"):
        _undo(done)
    assert (vault / "job.log").read_bytes() == b"root's"


def test_undo_removes_only_the_very_file_it_created(tmp_path: Path) -> None:
    path = tmp_path / "out.log"
    path.write_bytes(b"abc")
    captured = _capture(path, tmp_path / "img")
    path.unlink()
    done, _ = _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    assert done is not None
    path.rename(tmp_path / "moved")  # kept: its inode is not reused for the next file
    path.write_bytes(b"someone else's")  # another file at the name now
    _undo(done)
    assert path.read_bytes() == b"someone else's"


def test_a_hard_linked_file_or_one_of_another_owner_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    path = tmp_path / "log"
    path.write_bytes(b"v1")
    captured = _capture(path, tmp_path / "img")
    path.write_bytes(b"v2")
    os.link(path, tmp_path / "elsewhere")
    root = Root.node()
    try:
        assert "2 hard links" in check_file(root, captured).problem
    finally:
        root.close()
    with pytest.raises(UnsafePath, match="hard links"):
        _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    os.unlink(tmp_path / "elsewhere")
    os.chown(path, 65534, 65534)
    with pytest.raises(UnsafePath, match="now owned by uid 65534"):
        _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    assert path.read_bytes() == b"v2"


def test_a_crash_at_any_point_of_the_put_back_is_undone_from_the_journal(
    tmp_path: Path,
) -> None:
    """What each journaled record undoes: a ``.part`` aside left by a crash is removed
    (the file untouched); a complete aside is copied back into the file and removed."""
    path = tmp_path / "state.bin"
    path.write_bytes(b"checkpointed")
    captured = _capture(path, tmp_path / "img")
    path.write_bytes(b"found at restore")
    done, journal = _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    assert done is not None and journal == [replace(done, aside_ino=0, aside_uid=-1)]
    assert path.read_bytes() == b"checkpointed"
    aside = Path(done.aside)
    assert done.aside_ino == aside.stat().st_ino and done.aside_uid == aside.stat().st_uid
    assert aside.read_bytes() == b"found at restore" and aside.stat().st_mode & 0o777 == 0o600
    # a crash after the aside was complete and the file rewritten: the record undoes it
    _undo(journal[-1])
    assert path.read_bytes() == b"found at restore" and not aside.exists()
    # a crash while the aside was being written: only the temporary is there
    Path(done.temp).write_bytes(b"found at")
    _undo(journal[-1])
    assert not Path(done.temp).exists() and path.read_bytes() == b"found at restore"
    _undo(journal[-1])  # twice: nothing more
    assert path.read_bytes() == b"found at restore"


def test_a_sparse_file_is_captured_and_put_back_by_extent(tmp_path: Path) -> None:
    """A 2 GiB file with 8 KiB of data: seconds of reading and 2 GiB of staging before;
    now only the data, the image and the file put back sparse, the hash of every byte."""
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.write(b"head")
        f.seek(1 << 30)
        f.write(b"middle" * 1000)
        f.truncate(2 << 30)
    started = time.monotonic()
    captured = _capture(path, tmp_path / "img")
    took = time.monotonic() - started
    assert captured.size == 2 << 30
    assert os.stat(tmp_path / "img").st_blocks * 512 < 1 << 20, "the image is not sparse"
    want = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            want.update(chunk)
    assert captured.hash == want.hexdigest()
    assert took < 5.0, took
    path.unlink()
    done, _ = _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    assert done is not None and done.created
    assert path.stat().st_size == 2 << 30 and path.stat().st_blocks * 512 < 1 << 20
    with open(path, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(1 << 30)
        assert f.read(6) == b"middle"


def _rotate(d: Path) -> None:
    """What logging's RotatingFileHandler does: job.log.N -> N+1, job.log -> .1, new job.log."""
    n = max([int(p.name.rsplit(".", 1)[1]) for p in d.glob("job.log.[0-9]*")], default=0)
    for i in range(n, 0, -1):
        (d / f"job.log.{i}").rename(d / f"job.log.{i + 1}")
    (d / "job.log").rename(d / "job.log.1")
    (d / "job.log").write_bytes(b"")


def _rotating_capture(d: Path, image: Path, boot: str) -> CapturedFile:
    from dataclasses import replace

    from ckptd.adapters.procfs.putback import rotated_set
    root = Root.node()
    try:
        with root.locate(str(d / "job.log")) as loc:
            rotated = tuple((n, st.st_dev, st.st_ino)
                            for n, st in sorted(rotated_set(root, loc).items()))
    finally:
        root.close()
    return replace(_capture(d / "job.log", image), boot=boot, rotated=rotated)


def test_a_log_rotated_after_the_checkpoint_is_followed_and_its_set_made_as_then(
    tmp_path: Path,
) -> None:
    from ckptd.adapters.procfs.safefs import boot_id
    d = tmp_path / "d"
    d.mkdir()
    (d / "job.log.1").write_bytes(b"step 0\n")
    (d / "job.log").write_bytes(b"step 1\n")
    captured = _rotating_capture(d, tmp_path / "img", boot_id())
    then = {p.name: p.read_bytes() for p in d.iterdir()}
    (d / "job.log").open("ab").write(b"step 2\n")
    time.sleep(0.01)
    _rotate(d)
    (d / "job.log").write_bytes(b"step 3\n")
    _rotate(d)
    (d / "job.log").write_bytes(b"step 4\n")
    found = {p.name: p.read_bytes() for p in d.iterdir()}
    done, journal = _put(captured, tmp_path / "img", str(d / "job.log.ckptd-r1"))
    assert done is not None
    now = {p.name: p.read_bytes() for p in d.iterdir() if ".ckptd-" not in p.name}
    assert now == then  # no step twice: the set as at the checkpoint
    kept = {p.name: p.read_bytes() for p in d.iterdir() if ".ckptd-" in p.name}
    assert kept == {"job.log.ckptd-r1": b"step 4\n", "job.log.2.ckptd-r1": b"step 1\nstep 2\n",
                    "job.log.1.ckptd-r1": b"step 3\n"}
    for undo in [done, *reversed([j for j in journal if j.moved_from])]:
        _undo(undo)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == found


def test_a_rotation_is_not_followed_across_boots(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "job.log").write_bytes(b"step 1\n")
    captured = _rotating_capture(d, tmp_path / "img", "another-boot")
    _rotate(d)
    (d / "job.log").write_bytes(b"step 2\n")
    done, journal = _put(captured, tmp_path / "img", str(d / "job.log.ckptd-r1"))
    assert done is not None and not [j for j in journal if j.moved_from]
    assert (d / "job.log.1").read_bytes() == b"step 1\n"  # left as found


def test_without_openat2_root_refuses_rather_than_falls_back_to_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 5.6 (no openat2: ENOSYS, as for an unknown syscall number)."""
    from ckptd.adapters.procfs import safefs

    path = tmp_path / "log"
    path.write_bytes(b"v1")
    captured = _capture(path, tmp_path / "img")
    path.write_bytes(b"v2")
    monkeypatch.setattr(safefs, "SYS_OPENAT2", 100_000)  # no such syscall: ENOSYS
    with pytest.raises(UnsafePath, match="no openat2"):
        _put(captured, tmp_path / "img", str(path) + ".ckptd-r1")
    assert path.read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "log"]
