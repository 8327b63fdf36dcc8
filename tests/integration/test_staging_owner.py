"""Issue 33 (2): the RAM staging directory is root's alone. A real unprivileged user, with no
access to the daemon's socket, plants a link or a directory of their own where a daemon will
stage (a world-writable sticky parent, as /dev/shm is) before the real daemon starts: the
start is refused in one line naming ``fast_staging_dir``, and the root-only tree the link
names is untouched (the daemon before this fix deleted its content at start). A staging
directory the daemon makes is root:root 0700; a killed daemon's subdirectory is removed at
the next start, a stopped one's as it stops (they piled up before)."""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import Daemon, stop_cleanly

pytestmark = pytest.mark.integration

STAGER = "ckptd-stager"
USER_PYTHON = "/usr/bin/python3"
"""An interpreter any user may run (the venv's may live under a root-only home)."""


@pytest.fixture(scope="module")
def user() -> Iterator[int]:
    """A real unprivileged user, created for these tests (and removed after)."""
    created = False
    try:
        pwd.getpwnam(STAGER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                        STAGER], check=True)
        created = True
    try:
        yield pwd.getpwnam(STAGER).pw_uid
    finally:
        if created:
            subprocess.run(["userdel", STAGER], check=False)


@pytest.fixture
def area() -> Iterator[Path]:
    """A directory every user may traverse, holding ``shm`` (1777, as /dev/shm is) and
    ``vault``: a root-only tree (0700) with a 0600 file, what a planted link aims at."""
    path = Path(tempfile.mkdtemp(prefix="ckptd-staging-", dir="/tmp"))
    path.chmod(0o755)
    (path / "shm").mkdir()
    (path / "shm").chmod(0o1777)
    vault = path / "vault"
    (vault / "tree").mkdir(parents=True)
    vault.chmod(0o700)
    (vault / "tree" / "precious").write_bytes(b"precious\n")
    (vault / "tree" / "precious").chmod(0o600)
    (vault / "top").write_bytes(b"top\n")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, code: str, *args: object) -> None:
    proc = subprocess.run([USER_PYTHON, "-c", code, *map(str, args)], user=uid, group=uid,
                          extra_groups=[], cwd="/", stdin=subprocess.DEVNULL, check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"as uid {uid}: {code!r}: {proc.stderr}"


def vault_as_it_was(area: Path) -> list[tuple[str, bytes]]:
    vault = area / "vault"
    return sorted((str(p.relative_to(vault)), p.read_bytes() if p.is_file() else b"")
                  for p in vault.rglob("*"))


WAS = [("top", b"top\n"), ("tree", b""), ("tree/precious", b"precious\n")]


def refused_start(root: Path, staging: Path) -> str:
    """Start a real daemon staging in ``staging``: it must exit 2 at start; its one
    ``ckptd:`` line."""
    root.mkdir(exist_ok=True)
    try:
        d = Daemon(root, config={"fast_staging_dir": str(staging)})
    except AssertionError as exc:
        text = str(exc)
    else:
        stop_cleanly(d)
        pytest.fail(f"the daemon started, staging in {staging} (a user's)")
    assert text.startswith("ckptd exited with 2 at start"), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("ckptd:")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def tag_of(root: Path) -> str:
    """The per-daemon name the daemon before this fix used (state dir's hash)."""
    return hashlib.sha256(str((root / "state").resolve()).encode()).hexdigest()[:12]


def test_a_users_directory_holding_a_link_named_as_the_daemons_refuses_the_start(
    user: int, area: Path, tmp_path: Path,
) -> None:
    """The attack of the issue: the user makes the staging directory first and puts in it a
    link, named as the daemon's subdirectory, to a root-only tree; the daemon's start-up
    cleanup used to empty that tree."""
    root = tmp_path / "d"
    theirs = area / "shm" / "ckptd"
    as_user(user, "import os, sys; os.mkdir(sys.argv[1]); "
            "os.symlink(sys.argv[2], os.path.join(sys.argv[1], sys.argv[3]))",
            theirs, area / "vault", tag_of(root))
    line = refused_start(root, theirs)
    assert f"fast_staging_dir {theirs} is owned by uid {user}, not root" in line, line
    assert vault_as_it_was(area) == WAS, "root deleted what the user's link named"
    assert theirs.stat().st_uid == user and os.listdir(theirs) == [tag_of(root)]


def test_a_link_planted_as_the_staging_directory_refuses_the_start(
    user: int, area: Path, tmp_path: Path,
) -> None:
    link = area / "shm" / "ckptd"
    as_user(user, "import os, sys; os.symlink(sys.argv[2], sys.argv[1])", link,
            area / "vault")
    line = refused_start(tmp_path / "d", link)
    assert f"{link} is a symbolic link" in line and "fast_staging_dir" in line, line
    assert vault_as_it_was(area) == WAS
    assert link.is_symlink()


def test_the_staging_the_daemon_makes_is_roots_alone_and_a_killed_daemons_goes(
    user: int, area: Path, tmp_path: Path,
) -> None:
    staging = area / "shm" / "ckptd"
    (tmp_path / "d").mkdir()
    first = Daemon(tmp_path / "d", config={"fast_staging_dir": str(staging)})
    try:
        st = staging.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)
        (own,) = os.listdir(staging)
        assert re.fullmatch(rf"{tag_of(tmp_path / 'd')}-[0-9a-f]{{16}}", own), own
        assert stat.S_IMODE((staging / own).stat().st_mode) == 0o700
    finally:
        first.proc.kill()  # dies holding its staging: nothing removes it but the next start
        first.proc.wait(timeout=10)
    assert os.listdir(staging) == [own]
    second = Daemon(tmp_path / "d", config={"fast_staging_dir": str(staging)})
    try:
        (now,) = os.listdir(staging)
        assert now != own, "the killed daemon's staging is still there"
        assert f"removed the staging of a daemon no longer running: {staging / own}" in (
            second.log())
    finally:
        stop_cleanly(second)
    assert os.listdir(staging) == [], "a clean stop leaves its staging behind"
