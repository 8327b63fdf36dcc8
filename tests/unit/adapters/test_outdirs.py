"""``ProcJobFiles.in_dirs`` on real directories, as root acting for a user: no link followed
(in DIR or as DIR), only what the job's owner may read, never a FIFO opened, the tree's own
files left out by identity, each file held open so that a name swapped after the walk
changes nothing of what is read."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.filecopy import capture_file
from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.core.ports import WrittenFile

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acts for another uid: needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory nobody can reach (pytest's own tmp_path is under a 0700 directory)."""
    where = Path(tempfile.mkdtemp(prefix="ckptd-outdirs-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where)


@pytest.fixture
def out(base: Path) -> Path:
    tmp_path = base
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "log.csv").write_bytes(b"1,2\n")
    (out / "sub" / "ckpt.bin").write_bytes(b"\x01" * 5000)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's")
    secret.chmod(0o600)
    (out / "link").symlink_to(secret)
    (out / "linkdir").symlink_to(tmp_path)
    os.mkfifo(out / "fifo")
    for path in (out, out / "sub", out / "log.csv", out / "sub" / "ckpt.bin"):
        os.chown(path, NOBODY, NOBODY)
    (out / "private").write_bytes(b"root only")  # root's, 0600: nobody may not read it
    (out / "private").chmod(0o600)
    return out


def test_walks_as_the_owner_follows_no_link_and_opens_no_fifo(out: Path) -> None:
    with ProcJobFiles().in_dirs([str(out)], os.getpid(), NOBODY, NOBODY, (), 100) as found:
        assert [f.path for f in found.files] == [str(out / "log.csv"),
                                                 str(out / "sub" / "ckpt.bin")]
        assert all(f.size_free and not f.append_only for f in found.files)
        assert found.problems == (f"{out / 'private'} (the job's owner may not read it)",)
        assert not found.over


def test_a_dir_that_is_a_link_is_refused_not_followed(out: Path) -> None:
    with ProcJobFiles().in_dirs([str(out / "linkdir")], os.getpid(), 0, 0, (), 100) as found:
        assert found.files == ()
        assert len(found.problems) == 1 and "symbolic link" in found.problems[0]


def test_the_tree_s_own_files_are_left_out_and_the_limit_is_said(out: Path) -> None:
    own = WrittenFile(str(out / "log.csv"), 4, str(out / "log.csv"), os.getpid())
    with ProcJobFiles().in_dirs([str(out)], os.getpid(), 0, 0, [own], 1) as found:
        assert [f.path for f in found.files] == [str(out / "private")]
        assert found.over


def test_what_is_read_is_the_file_held_not_what_has_its_name_now(
    out: Path, base: Path, tmp_path: Path
) -> None:
    with ProcJobFiles().in_dirs([str(out / "sub")], os.getpid(), 0, 0, (), 100) as found:
        (out / "sub" / "ckpt.bin").rename(out / "sub" / "moved")
        (out / "sub" / "ckpt.bin").symlink_to(base / "secret")
        captured = capture_file(found.files[0], tmp_path / "image")
    assert captured is not None and captured.size == 5000
    assert (tmp_path / "image").read_bytes()[:5000] == b"\x01" * 5000
