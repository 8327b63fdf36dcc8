"""A bound unix socket's directory that is gone at a restore (multiprocessing's
``/tmp/pymp-*``, removed by a worker that ended on its own after its loop was killed) is made
again by ``pin_paths`` for CRIU's bind: ``0700`` and the socket owner's, only below a
directory that exists, and removed at ``close`` only while it is that very, empty
directory."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.pathpins import ProcPinnedPaths, pin_paths
from ckptd.adapters.procfs.safefs import Root
from ckptd.core.ports import CriuPaths
from ckptd.core.ports.criu import CriuCreates

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes root's and nobody's dirs")


@pytest.fixture
def sticky() -> Iterator[Path]:
    """A directory as /tmp is: root's, world-writable, sticky."""
    where = Path(tempfile.mkdtemp(prefix="ckptd-sockdir-"))
    where.chmod(0o1777)
    yield where
    shutil.rmtree(where)


def _pins(path: Path, owner: int = NOBODY) -> ProcPinnedPaths:
    return pin_paths(Root.node(), CriuPaths(created=(
        CriuCreates(str(path), "unix socket", owner),)), owns_root=True)


def test_the_missing_directory_is_made_the_owner_s_and_removed_when_left_empty(
    sticky: Path,
) -> None:
    sock = sticky / "pymp-x1" / "listener-y"
    pins = _pins(sock)
    st = (sticky / "pymp-x1").stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == NOBODY
    pins.close()
    assert not (sticky / "pymp-x1").exists()  # the restore failed before CRIU bound


def test_it_is_kept_once_the_socket_is_bound_in_it(sticky: Path) -> None:
    sock = sticky / "pymp-x2" / "listener-y"
    pins = _pins(sock)
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(sock))  # what CRIU does
    pins.close()
    bound.close()
    assert sock.exists()


def test_an_existing_directory_or_a_missing_parent_is_left_alone(sticky: Path) -> None:
    (sticky / "there").mkdir(mode=0o755)
    pins = _pins(sticky / "there" / "s")
    pins.close()
    assert (sticky / "there").is_dir() and (sticky / "there").stat().st_uid == 0
    pins = _pins(sticky / "gone" / "deeper" / "s")
    pins.close()
    assert not (sticky / "gone").exists()


def test_a_socket_of_root_s_alone_gets_no_directory(sticky: Path) -> None:
    pins = _pins(sticky / "pymp-x3" / "s", owner=-1)
    pins.close()
    assert not (sticky / "pymp-x3").exists()
