"""The restore's output file is opened with the job owner's rights when the caller chose its
path (a user must not make root write where it cannot), and given to the owner when the daemon
chose it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.stdio import LocalStdioProvider
from ckptd.domain import StdioFact, StdioKind
from ckptd.errors import StoreError

NOBODY = (65534, 65534)
PIPE_OUT = (StdioFact(pid=1, fd=1, kind=StdioKind.PIPE, target="pipe:[1]",
                      external_key="pipe:[1]", writable=True),)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to act as another uid)")


def test_a_path_the_user_chose_in_a_root_only_directory_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    with pytest.raises(StoreError, match="Permission denied"), LocalStdioProvider(
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
