"""The ``JobFiles`` contract: ``ProcJobFiles`` (real processes, /proc) and ``FakeJobFiles``
(files declared written by fake pids) list, capture and put back files alike."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.core.ports import JobFiles, PutBack
from ckptd.domain import ProcessFact
from ckptd.testing import FakeJobFiles


class FilesHarness:
    def __init__(self, files: JobFiles) -> None:
        self.files = files

    def writer(self, path: Path) -> tuple[ProcessFact, ...]:
        """A process tree that has ``path`` open for writing."""
        raise NotImplementedError

    def outsider(self, path: Path) -> tuple[int, str]:
        """Another process, outside any tree given, that has ``path`` open for writing: its
        pid and command."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class RealFiles(FilesHarness):
    def __init__(self) -> None:
        super().__init__(ProcJobFiles())
        self.procs: list[subprocess.Popen[bytes]] = []

    def writer(self, path: Path) -> tuple[ProcessFact, ...]:
        code = ("import sys, time; f = open(sys.argv[1], 'ab'); print('ok', flush=True); "
                "time.sleep(60)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)],
                                stdout=subprocess.PIPE)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
        return ProcFsTable().tree(proc.pid)

    def outsider(self, path: Path) -> tuple[int, str]:
        pid = self.writer(path)[0].pid
        return pid, Path(f"/proc/{pid}/comm").read_text().strip()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class FakeFiles(FilesHarness):
    def __init__(self) -> None:
        self.fake = FakeJobFiles()
        super().__init__(self.fake)
        self.next_pid = 5000

    def writer(self, path: Path) -> tuple[ProcessFact, ...]:
        self.next_pid += 1
        path.touch()
        self.fake.open_for_writing(self.next_pid, path)
        return (ProcessFact(self.next_pid, 1, "w", (), 0, 0),)

    def outsider(self, path: Path) -> tuple[int, str]:
        self.next_pid += 1
        self.fake.written_outside(path, self.next_pid, "python3")
        return self.next_pid, "python3"


@pytest.fixture(params=["real", "fake"])
def harness(request: pytest.FixtureRequest) -> Iterator[FilesHarness]:
    h: FilesHarness = RealFiles() if request.param == "real" else FakeFiles()
    try:
        yield h
    finally:
        h.close()


def test_written_lists_a_file_open_for_writing(harness: FilesHarness, tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(b"hello\n")
    tree = harness.writer(path)
    written = harness.files.written(tree)
    assert [(w.path, w.size, w.pid) for w in written] == [(str(path), 6, tree[0].pid)]


def test_capture_copies_the_content_padded_to_pages(harness: FilesHarness, tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    path.write_bytes(b"\x07" * 5000)
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img")
    assert captured is not None
    assert (captured.path, captured.size, captured.image) == (str(path), 5000, "img")
    data = (tmp_path / "img").read_bytes()
    assert data == b"\x07" * 5000 + b"\0" * (8192 - 5000)
    assert captured.mode == path.stat().st_mode & 0o7777


def test_put_back_keeps_the_version_found_and_undo_restores_it(
    harness: FilesHarness, tmp_path: Path
) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(b"line 1\n")
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img")
    assert captured is not None
    path.write_bytes(b"line 1\nline 2\n")
    check = harness.files.check(captured, 0, 0)
    assert check.differs and not check.problem
    aside = str(tmp_path / "train.log.ckptd-r1")
    journaled: list[PutBack] = []
    done = harness.files.put_back(captured, tmp_path / "img", aside, 0, 0, journaled.append)
    assert done is not None and done.aside == aside
    # told before the aside existed; the aside as made (its identity, for the record)
    assert journaled == [replace(done, aside_ino=0, aside_uid=-1)]
    made = os.stat(aside)
    assert (done.dev, done.aside_ino, done.aside_uid) == (made.st_dev, made.st_ino, made.st_uid)
    assert path.read_bytes() == b"line 1\n"
    assert Path(aside).read_bytes() == b"line 1\nline 2\n"
    assert not harness.files.check(captured, 0, 0).differs
    assert harness.files.put_back(captured, tmp_path / "img", aside + "x", 0, 0,
                                  journaled.append) is None
    harness.files.undo(done, 0, 0)
    assert path.read_bytes() == b"line 1\nline 2\n"
    assert not Path(aside).exists()


def test_a_missing_file_is_recreated_and_undo_removes_it(
    harness: FilesHarness, tmp_path: Path
) -> None:
    path = tmp_path / "out.txt"
    path.write_bytes(b"abc")
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img")
    assert captured is not None
    path.unlink()
    journaled: list[PutBack] = []
    done = harness.files.put_back(captured, tmp_path / "img", str(path) + ".aside", 0, 0,
                                  journaled.append)
    assert done is not None and done.aside == "" and done.created
    assert journaled[-1] == done and done.ino == path.stat().st_ino
    assert path.read_bytes() == b"abc"
    harness.files.undo(done, 0, 0)
    assert not path.exists()


def test_check_names_what_blocks_a_put_back(harness: FilesHarness, tmp_path: Path) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    path = sub / "x.log"
    path.write_bytes(b"x")
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img")
    assert captured is not None
    path.unlink()
    sub.rename(tmp_path / "gone")  # kept: its inode is not reused by the next directory
    assert harness.files.check(captured, 0, 0).problem == f"its directory {sub} is missing"
    sub.mkdir()  # another directory than the one the job wrote into (same boot)
    assert "was replaced since the checkpoint" in harness.files.check(captured, 0, 0).problem


def test_check_refuses_what_is_no_longer_a_regular_file(
    harness: FilesHarness, tmp_path: Path
) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(b"x")
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img")
    assert captured is not None
    path.unlink()
    path.mkdir()
    assert harness.files.check(captured, 0, 0).problem == "it is no longer a regular file"


def test_a_precopy_then_only_the_tail_or_all_when_the_file_shrank(
    harness: FilesHarness, tmp_path: Path
) -> None:
    path = tmp_path / "app.log"
    path.write_bytes(b"a" * 5000)
    (written,) = harness.files.written(harness.writer(path))
    early = harness.files.precopy(written, tmp_path / "img")
    assert early is not None and early.size == 5000
    with open(path, "ab") as f:
        f.write(b"b" * 100)
    (written,) = harness.files.written(harness.writer(path))
    captured = harness.files.capture(written, tmp_path / "img", early)
    assert captured is not None and captured.size == 5100
    assert (tmp_path / "img").read_bytes()[:5100] == b"a" * 5000 + b"b" * 100
    full = harness.files.capture(written, tmp_path / "full")
    assert full is not None and full.hash == captured.hash
    path.write_bytes(b"c" * 10)  # shorter now: copied whole
    captured = harness.files.capture(written, tmp_path / "img", early)
    assert captured is not None and captured.size == 10
    assert (tmp_path / "img").read_bytes() == b"c" * 10 + b"\0" * 4086


def test_remove_aside_removes_only_the_very_copy_recorded(
    harness: FilesHarness, tmp_path: Path
) -> None:
    """Issue 33 (6): a copy is removed by its recorded identity, never by its name alone."""
    copy = tmp_path / "train.log.ckptd-r1"
    copy.write_bytes(b"kept")
    made = copy.stat()
    ident = (made.st_dev, made.st_ino, made.st_uid)
    planted = tmp_path / "train.log.ckptd-r2"  # named like a copy, never recorded as one
    planted.write_bytes(b"someone's")
    other = planted.stat()
    (tmp_path / "train.log.ckptd-r3").symlink_to(copy)  # a link to the copy: not the copy
    assert harness.files.remove_aside(str(tmp_path / "train.log.ckptd-r3"), *ident, 0, 0) \
        .startswith("another file")
    assert harness.files.remove_aside(str(planted), *ident, 0, 0).startswith("another file")
    assert harness.files.remove_aside(str(copy), other.st_dev, other.st_ino, other.st_uid,
                                      0, 0).startswith("another file")
    assert copy.exists() and planted.read_bytes() == b"someone's"
    assert harness.files.remove_aside(str(copy), *ident, 0, 0) == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train.log.ckptd-r2", "train.log.ckptd-r3"]
    assert harness.files.remove_aside(str(copy), *ident, 0, 0) == "it is gone already"


def test_shared_names_the_other_writers_of_the_tree_s_files_and_only_theirs(
    harness: FilesHarness, tmp_path: Path
) -> None:
    shared_log, own_log = tmp_path / "shared.log", tmp_path / "own.log"
    shared_log.write_bytes(b"x\n")
    own_log.write_bytes(b"y\n")
    tree = harness.writer(shared_log) + harness.writer(own_log)
    other, command = harness.outsider(shared_log)
    tree_pids = {p.pid for p in tree}
    written = harness.files.written(tree)
    assert sorted(w.path for w in written) == [str(own_log), str(shared_log)]
    at_dump = harness.files.shared(written, tree_pids)
    assert [(s.path, [pid for pid, _ in s.writers]) for s in at_dump] == [
        (str(shared_log), [other])]
    assert at_dump[0].writers[0][1] == command and at_dump[0].size == 2
    assert at_dump[0].named == f"pid {other} ({command})"
    # at a restore: the captured files at their paths, found by identity
    captured = [c for i, w in enumerate(written)
                if (c := harness.files.capture(w, tmp_path / f"{i}.img"))]
    at_restore = harness.files.shared(captured, tree_pids)
    assert [(s.path, [pid for pid, _ in s.writers]) for s in at_restore] == [
        (str(shared_log), [other])]
    # a file now at that path is another one: its writer is not the captured file's
    shared_log.rename(tmp_path / "moved.log")
    shared_log.write_bytes(b"new\n")
    if isinstance(harness, RealFiles):
        assert harness.files.shared(captured, tree_pids) == ()


def test_in_dirs_holds_every_regular_file_under_the_dirs_but_the_tree_s_own(
    harness: FilesHarness, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "metrics.csv").write_bytes(b"0,a\n")
    (out / "sub" / "step-4.bin").write_bytes(b"\x07" * 5000)
    (out / "link").symlink_to(out / "metrics.csv")
    own = out / "train.log"
    own.write_bytes(b"open\n")
    tree = harness.writer(own)
    written = harness.files.written(tree)
    with harness.files.in_dirs([str(out), str(tmp_path / "gone")], tree[0].pid, 0, 0,
                               written, 10) as found:
        assert [f.path for f in found.files] == [str(out / "metrics.csv"),
                                                 str(out / "sub" / "step-4.bin")]
        assert found.problems == (f"{tmp_path / 'gone'} (no such directory)",)
        captured = harness.files.capture(found.files[1], tmp_path / "image")
    assert captured is not None and captured.size == 5000
    with harness.files.in_dirs([str(out)], tree[0].pid, 0, 0, written, 1) as found:
        assert len(found.files) == 1 and found.over
