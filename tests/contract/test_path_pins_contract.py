"""Contract of ``JobFiles.pin`` (issue 33.1), the real adapter over /proc and the fake.

Each holder below is a process that opened objects by path as CRIU does (following links):
the real one a real process, the fake one ``FakeJobFiles.opens``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.adapters.procfs.safefs import UnsafePath
from ckptd.core.ports import CriuCreates, CriuPaths, JobFiles
from ckptd.testing import FakeJobFiles

Holder = Callable[[Path], int]
"""Opens ``path`` (following links), holds it; the holder's pid."""

HOLD = "import sys, time; f = open(sys.argv[1], 'rb'); print('ok', flush=True); time.sleep(60)"


@pytest.fixture(params=["real", "fake"])
def port(request: pytest.FixtureRequest) -> Iterator[tuple[JobFiles, Holder]]:
    if request.param == "fake":
        fake = FakeJobFiles()
        pids = iter(range(70000, 80000))

        def fake_hold(path: Path) -> int:
            pid = next(pids)
            fake.opens[pid] = [("fd 3", str(path))]
            return pid

        yield fake, fake_hold
        assert fake.open_pins == 0
        return
    procs: list[subprocess.Popen[bytes]] = []

    def hold(path: Path) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
        procs.append(proc)
        return proc.pid

    try:
        yield ProcJobFiles(), hold
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _about_obj(stray: tuple[str, ...]) -> list[str]:
    """The lines about the test's object (a real holder also holds its interpreter, ...)."""
    return [line for line in stray if line.endswith("/obj'")]


def _layout(tmp: Path) -> tuple[Path, Path]:
    data = tmp / "data"
    data.mkdir()
    (data / "obj").write_bytes(b"the job's\n")
    vault = tmp / "vault"
    vault.mkdir()
    (vault / "obj").write_bytes(b"root's\n")
    return data, vault


def test_the_pinned_object_passes(port: tuple[JobFiles, Holder], tmp_path: Path) -> None:
    files, hold = port
    data, _ = _layout(tmp_path)
    top = "/" + str(tmp_path).split("/")[1]  # "/tmp": of the root's directory, like "/"
    pins = files.pin(CriuPaths(opened=(top, "/", str(data / "obj"), str(data))))
    try:
        pid = hold(data / "obj")
        assert _about_obj(pins.stray(pid)) == []
    finally:
        pins.close()


def test_an_object_reached_through_a_swapped_directory_is_stray(
    port: tuple[JobFiles, Holder], tmp_path: Path
) -> None:
    files, hold = port
    data, vault = _layout(tmp_path)
    pins = files.pin(CriuPaths(opened=(str(data / "obj"),)))
    try:
        os.rename(data, tmp_path / "data.old")
        os.symlink(vault, data)
        pid = hold(data / "obj")
        stray = _about_obj(pins.stray(pid))
        assert len(stray) == 1 and stray[0].endswith(f"is '{vault / 'obj'}'"), stray
    finally:
        pins.close()


def test_a_link_on_the_way_is_refused(port: tuple[JobFiles, Holder], tmp_path: Path) -> None:
    files, _ = port
    data, vault = _layout(tmp_path)
    os.rename(data, tmp_path / "data.old")
    os.symlink(vault, data)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        files.pin(CriuPaths(opened=(str(data / "obj"),)))


def test_what_criu_creates_goes_only_where_root_alone_writes(
    port: tuple[JobFiles, Holder], tmp_path: Path
) -> None:
    files, _ = port
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by all, not sticky
    with pytest.raises(UnsafePath, match="is writable by every user"):
        files.pin(CriuPaths(created=(CriuCreates(str(open_dir / "s.sock"), "unix socket"),)))
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: nobody can replace what root makes there
    if os.geteuid() == 0:
        files.pin(CriuPaths(created=(CriuCreates(str(sticky / "s.sock"), "unix socket"),))).close()


def test_a_unix_socket_may_lie_in_its_owners_own_directory(
    port: tuple[JobFiles, Holder], tmp_path: Path
) -> None:
    """Python's forkserver and multiprocessing managers bind theirs in the job owner's
    /tmp/pymp-*: a socket file holds no content. Another uid's directory stays refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    files, _ = port
    pymp = tmp_path / "pymp-x"
    pymp.mkdir(mode=0o700)
    os.chown(pymp, 4242, 4242)
    files.pin(CriuPaths(created=(CriuCreates(str(pymp / "listener"), "unix socket", 4242),))
              ).close()
    with pytest.raises(UnsafePath, match="is owned by uid 4242"):
        files.pin(CriuPaths(created=(CriuCreates(str(pymp / "listener"), "unix socket", 7),)))
    with pytest.raises(UnsafePath, match="is owned by uid 4242"):
        files.pin(CriuPaths(created=(CriuCreates(str(pymp / "x.cr.1.ghost"), "ghost file"),)))
