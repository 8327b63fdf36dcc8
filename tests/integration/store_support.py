"""Helpers of the store tests (test_store_*.py): the store's files, CRIU left over by a killed
daemon, daemons that are SIGKILLed on purpose, and inotify to kill one at a precise moment.

Nothing here fakes anything: these look at the real store directory and real processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import select
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .conftest import criu_path
from .support import (
    Daemon,
    assert_ok,
    assert_same_lines,
    proc_state,
    step_of,
    stop_cleanly,
)

FAST_STAGING = Path("/run/ckptd/staging")
"""The daemon's default ``fast_staging_dir`` (ckptd/daemon/config.py)."""


# ---- the store's files ------------------------------------------------------------------------


def store_files(store: Path, sub: str) -> list[Path]:
    """Regular files under ``store/sub``, temporaries included, sorted."""
    top = store / sub
    return sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else []


def largest_pack(store: Path) -> Path:
    packs = store_files(store, "packs")
    assert packs, f"no pack under {store / 'packs'}"
    return max(packs, key=lambda p: p.stat().st_size)


def manifest_refs(store: Path, checkpoint_id: str) -> tuple[set[str], set[str]]:
    """The packs and blobs the manifest of a checkpoint names, read from disk (the JSON line
    before its checksum line: see ckptd/core/store/manifest.py)."""
    data = (store / "manifests" / checkpoint_id).read_bytes()
    body = json.loads(data.rstrip(b"\n").rpartition(b"\n")[0])
    return set(body["packs"]), set(body["blobs"])


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` (negative: from the end), in place."""
    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        pos = offset if offset >= 0 else size + offset
        assert 0 <= pos < size, f"offset {offset} is outside {path} ({size} bytes)"
        fh.seek(pos)
        old = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([old[0] ^ 0xFF]))


def temporaries(*roots: Path) -> list[Path]:
    """Files a crash may leave behind (``.tmp.`` in their name) under ``roots``."""
    out: list[Path] = []
    for root in roots:
        if root.is_dir():
            out += [p for p in root.rglob("*") if ".tmp." in p.name]
    return sorted(out)


def staging_dirs(state_dir: Path) -> list[Path]:
    """Where a daemon with this state dir stages CRIU images: ``state/staging`` and its own
    subdirectory of the fast staging dir, ``<tag>-<random>`` (named as ckptd/daemon/wiring.py
    names it: that of the running daemon, or of a killed one until the next start removes
    it)."""
    tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return [state_dir / "staging", *sorted(FAST_STAGING.glob(f"{tag}-*"))]


def leftovers(store: Path, state_dir: Path) -> list[str]:
    """What a daemon that has started (and so recovered) and is idle must not have: partial
    objects, staging or restore directories, leases of dumps in flight, journal entries."""
    bad = [f"temporary file {p}" for p in temporaries(store, state_dir)]
    for d in staging_dirs(state_dir):
        if d.is_dir():
            bad += [f"staging left: {p}" for p in sorted(d.iterdir())]
    bad += [f"lease left: {p}" for p in store_files(store, "leases")]
    journal = state_dir / "journal"
    if journal.is_dir():
        bad += [f"journal entry left: {p}" for p in sorted(journal.iterdir())]
    return bad


# ---- CRIU processes a killed daemon left --------------------------------------------------------


def criu_pids(state_dir: Path) -> list[int]:
    """Running ``criu`` processes started by a daemon with this state dir (found by the
    CRIU_LIBS_DIR the daemon gives them: ``state_dir/criu-plugins``)."""
    marker = f"CRIU_LIBS_DIR={state_dir / 'criu-plugins'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().strip() != "criu":
                continue
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                state = proc_state(int(entry.name))
                if state not in (None, "Z", "X"):
                    found.append(int(entry.name))
    return found


def wait_criu_gone(state_dir: Path, timeout: float = 20.0) -> float:
    """Wait (bounded) for the CRIU a killed daemon left running to finish or fail on its own;
    returns how long that took. On timeout, the CRIU is killed (by pid) and the test fails."""
    start = time.monotonic()
    while True:
        pids = criu_pids(state_dir)
        if not pids:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"CRIU {pids} still running {timeout:g}s after its daemon died")
        time.sleep(0.02)


# ---- daemons ------------------------------------------------------------------------------------


class Daemons:
    """Daemons a test runs on one store and state directory, one at a time: started with
    ``start`` (each with its own log and socket under ``root/<n>``), SIGKILLed with ``kill9``
    or stopped (SIGTERM, exit 0 asserted) with ``stop``. ``close`` kills any still running."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "store"
        self.state_dir = root / "state"
        self._all: list[Daemon] = []

    def start(self, *extra: str, config: dict[str, Any] | None = None) -> Daemon:
        criu = criu_path()
        d = Daemon(
            self.root / f"d{len(self._all)}",
            *(["--criu", criu] if criu else []),
            "--store", str(self.store), "--state-dir", str(self.state_dir), *extra,
            config=config,
        )
        d.store, d.state_dir = self.store, self.state_dir
        self._all.append(d)
        return d

    @staticmethod
    def kill9(d: Daemon) -> None:
        d.proc.kill()
        d.proc.wait(timeout=10)

    @staticmethod
    def stop(d: Daemon) -> None:
        stop_cleanly(d)

    def close(self) -> None:
        for d in self._all:
            if d.proc.poll() is None:
                self.kill9(d)


def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str, str]:
    """Wait for a ``ckptctl`` started with ``Daemon.popen``: (exit code, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# ---- checks -------------------------------------------------------------------------------------


def assert_verify_clean(d: Daemon, expect_ids: list[str] | None = None) -> dict[str, Any]:
    res = d.ctl("verify")
    assert res.rc == 0, f"ckptctl verify exit {res.rc}: {res.out!r} {res.err.strip()}"
    report: dict[str, Any] = assert_ok(res, "verify")
    assert report["ok"] is True and report["problems"] == [], report
    if expect_ids is not None:
        assert sorted(report["checked"]) == sorted(expect_ids), (
            f"verify checked {report['checked']}, the listed checkpoints are {expect_ids}"
        )
    return report


def assert_prefix_continues(post: list[str], ref: list[str], low: int, high: int) -> int:
    """Like ``support.assert_continues_from_dump_point`` for a restored process that was
    stopped early: ``post`` (its first lines) is the reference from the step after the dump
    point on, and the dump point lies between ``low`` and ``high`` lines. Returns the point."""
    assert post, "the restored process printed nothing"
    point = step_of(post[0]) - 1
    assert low <= point <= high, (
        f"restored process starts at step {point + 1}, but {low} lines were printed before "
        f"the dump and {high} when it was checked"
    )
    assert_same_lines(post, ref[point : point + len(post)], f"restored at step {point + 1}")
    return point


def kill_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL a process that is not our child (a restored one) and wait until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in (None, "Z", "X"):
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL for {timeout:g}s"
        time.sleep(0.01)


# ---- inotify: to kill a daemon at a precise point -----------------------------------------------

IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


class Inotify:
    """Events (directory, name, mask) on a few directories (not recursive)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, Path] = {}

    def watch(self, directory: Path, mask: int) -> None:
        wd = self._libc.inotify_add_watch(self.fd, str(directory).encode(), mask)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        self._dirs[wd] = directory

    def events(self, timeout: float) -> Iterator[tuple[Path, str, int]]:
        """Events as they come, until ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            data = os.read(self.fd, 65536)
            pos = 0
            while pos < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                pos += _EVENT.size
                name = data[pos : pos + length].rstrip(b"\0").decode()
                pos += length
                yield self._dirs.get(wd, Path("?")), name, mask

    def close(self) -> None:
        os.close(self.fd)


def kill_on(
    d: Daemon, watches: list[tuple[Path, int]], hit: Callable[[Path, str, int], bool],
    timeout: float, also_stop: Callable[[], bool] = lambda: False,
) -> bool:
    """SIGKILL ``d`` at the first event ``hit`` accepts (True), or after ``timeout`` seconds or
    once ``also_stop()`` (checked between events) says so (False)."""
    ino = Inotify()
    try:
        for directory, mask in watches:
            ino.watch(directory, mask)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not also_stop():
            for directory, name, mask in ino.events(0.05):
                if hit(directory, name, mask):
                    d.proc.kill()
                    d.proc.wait(timeout=10)
                    return True
        d.proc.kill()
        d.proc.wait(timeout=10)
        return False
    finally:
        ino.close()


def tracer_of(pid: int) -> int:
    """The pid tracing ``pid`` (CRIU while it dumps it), 0 if none or no such process."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def kill_when(
    d: Daemon, predicate: Callable[[], bool], timeout: float,
    also_stop: Callable[[], bool] = lambda: False,
) -> bool:
    """SIGKILL ``d`` as soon as ``predicate()`` holds (polled every millisecond): True; or
    after ``timeout`` seconds or once ``also_stop()`` says so: False."""
    deadline = time.monotonic() + timeout
    fired = False
    while time.monotonic() < deadline and not also_stop():
        if predicate():
            fired = True
            break
        time.sleep(0.001)
    d.proc.kill()
    d.proc.wait(timeout=10)
    return fired
