"""Issue 33 (2): the RAM staging directory is root's alone (ckptd/adapters/procfs/staging.py):
made root:root 0700 with no link followed; a link, another owner, or a parent others could
rename it in refuses the start in one line; each daemon's subdirectory is unpredictable and
locked; dead daemons' are removed fd-relative, and only when they are root's."""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.staging import FastStaging, StagingRefused, claim

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")

USER = 4242
"""A uid that is not root's (no account needed: only ownership matters)."""
TAG = "0123456789ab"


@pytest.fixture
def top(tmp_path: Path) -> Path:
    """A root-owned parent like /run (0755), under pytest's root-owned tmp_path."""
    tmp_path.chmod(0o755)
    return tmp_path


@pytest.fixture
def taken() -> Iterator[list[FastStaging]]:
    claims: list[FastStaging] = []
    yield claims
    for c in claims:
        c.close()


def vault(top: Path) -> Path:
    """A root-only tree: what a planted link would make root delete."""
    v = top / "vault"
    (v / "data").mkdir(parents=True)
    v.chmod(0o700)
    (v / "data" / "precious").write_bytes(b"precious\n")
    return v


def intact(v: Path) -> bool:
    return (v / "data" / "precious").read_bytes() == b"precious\n"


def one_line(exc: pytest.ExceptionInfo[StagingRefused], *needles: str) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    for n in needles:
        assert n in text, (n, text)
    return text


def test_made_root_only_with_an_unpredictable_locked_subdirectory(
        top: Path, taken: list[FastStaging]) -> None:
    staging = top / "run" / "ckptd" / "staging"
    old = os.umask(0o077)  # whatever the umask: 0755 above, 0700 the staging
    try:
        a = claim(str(staging), TAG)
        taken.append(a)
    finally:
        os.umask(old)
    st = staging.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)
    assert stat.S_IMODE((top / "run" / "ckptd").stat().st_mode) == 0o755
    assert re.fullmatch(rf"{TAG}-[0-9a-f]{{16}}", a.path.name), a.path
    assert a.path.parent == staging and a.removed == [] and a.left == []
    assert stat.S_IMODE(a.path.stat().st_mode) == 0o700
    b = claim(str(staging), TAG)  # a second daemon (same tag): its own directory
    taken.append(b)
    assert b.path != a.path and a.path.is_dir(), "a live daemon's directory is kept"
    probe = os.open(a.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)


def test_a_dead_daemons_directory_goes_a_users_and_a_link_stay_nothing_followed(
        top: Path, taken: list[FastStaging]) -> None:
    v = vault(top)
    staging = top / "staging"
    first = claim(str(staging), TAG)
    (first.path / "ck-1" / "images").mkdir(parents=True)
    (first.path / "ck-1" / "link").symlink_to(v)  # inside a dead daemon's: the link goes
    first.close()  # that daemon died
    stale_old = staging / TAG  # the layout before: a bare tag, never locked
    stale_old.mkdir(mode=0o700)
    (staging / "theirs").mkdir()
    os.chown(staging / "theirs", USER, USER)
    (staging / "theirs" / "f").write_bytes(b"x")
    (staging / "planted").symlink_to(v)

    second = claim(str(staging), TAG)
    taken.append(second)
    assert sorted(second.removed) == sorted([str(first.path), str(stale_old)])
    assert not first.path.exists() and not stale_old.exists()
    assert intact(v), "a link in a dead daemon's directory was followed"
    assert (staging / "theirs" / "f").read_bytes() == b"x", "a user's directory was removed"
    assert (staging / "planted").is_symlink() and intact(v)
    assert len(second.left) == 2 and all("uid" in w for w in second.left), second.left


def test_a_link_as_the_staging_directory_or_on_the_way_is_refused(top: Path) -> None:
    v = vault(top)
    (top / "shm").symlink_to(v)
    with pytest.raises(StagingRefused) as exc:
        claim(str(top / "shm"), TAG)
    one_line(exc, f"{top / 'shm'} is a symbolic link", "fast_staging_dir")
    with pytest.raises(StagingRefused) as exc:
        claim(str(top / "shm" / "ckptd"), TAG)
    one_line(exc, f"{top / 'shm'} is a symbolic link")
    assert sorted(p.name for p in v.iterdir()) == ["data"] and intact(v)


def test_a_users_staging_directory_is_refused_and_left_as_it_is(top: Path) -> None:
    shm = top / "shm"
    shm.mkdir()
    shm.chmod(0o1777)  # like /dev/shm: anyone may make the staging directory first
    theirs = shm / "ckptd"
    theirs.mkdir()
    os.chown(theirs, USER, USER)
    v = vault(top)
    (theirs / TAG).symlink_to(v)  # the attack of issue 33: root would clean the vault
    with pytest.raises(StagingRefused) as exc:
        claim(str(theirs), TAG)
    one_line(exc, f"fast_staging_dir {theirs} is owned by uid {USER}, not root")
    assert intact(v) and sorted(p.name for p in theirs.iterdir()) == [TAG]
    st = theirs.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (USER, 0o755)


def test_parents_others_could_rename_it_in_are_refused_sticky_ones_are_not(
        top: Path, taken: list[FastStaging]) -> None:
    open_dir = top / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # not sticky: anyone may rename what is in it
    with pytest.raises(StagingRefused) as exc:
        claim(str(open_dir / "staging"), TAG)
    one_line(exc, f"{open_dir} is writable by others (mode 0777) and not sticky")
    assert not (open_dir / "staging").exists()

    home = top / "home"
    home.mkdir()
    os.chown(home, USER, USER)
    with pytest.raises(StagingRefused) as exc:
        claim(str(home / "staging"), TAG)
    one_line(exc, f"{home} is owned by uid {USER}")

    shm = top / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    taken.append(claim(str(shm / "ckptd"), TAG))
    st = (shm / "ckptd").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)


def test_a_root_owned_staging_directory_open_to_others_is_made_root_only(
        top: Path, taken: list[FastStaging]) -> None:
    staging = top / "staging"
    staging.mkdir()
    staging.chmod(0o755)  # what an older daemon's mkdir(parents=True) left
    os.chown(staging, 0, USER)
    taken.append(claim(str(staging), TAG))
    st = staging.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)


def test_a_relative_or_dotted_path_is_refused(top: Path) -> None:
    for bad in ("run/ckptd", f"{top}/../x"):
        with pytest.raises(StagingRefused) as exc:
            claim(bad, TAG)
        one_line(exc, "fast_staging_dir", "absolute path")


def test_a_clean_stop_removes_its_own_directory_only(top: Path, taken: list[FastStaging]) -> None:
    staging = top / "staging"
    other = claim(str(staging), TAG)
    taken.append(other)
    mine = claim(str(staging), TAG)
    (mine.path / "restore-x" / "images").mkdir(parents=True)
    mine.release()
    assert not mine.path.exists() and other.path.is_dir() and staging.is_dir()
    assert mine.fd == mine.parent_fd == -1
