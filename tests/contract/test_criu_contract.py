"""Contract of ``Criu``: ``CriuSwrk`` over real CRIU and ``FakeCriu`` behave the same on a
trivial process (a ``sleep``; see core/ports/). Real CRIU needs root and a CRIU whose ``check``
passes: otherwise its cases are skipped, with the reason.

Implementations are listed in ``CRIUS`` (a new one is one line there); each harness spawns a
trivial process, tells its state, and cleans up what it spawned or restored."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.adapters.criu import CriuSwrk
from ckptd.core.ports import Criu, CriuDumpJob, CriuHooks, CriuRestoreJob
from ckptd.domain import PidState
from ckptd.errors import CriuFailed
from ckptd.testing import FakeCriu, FakeProcessTable, RecordingHooks


@dataclass
class CriuHarness:
    criu: Criu
    spawn: Callable[[], int]
    """A trivial process (stdio on /dev/null, a session of its own); its pid."""
    state: Callable[[int], str]
    """"running", "stopped" or "gone" (exited: zombie or freed)."""
    reap: Callable[[int], None]
    """Free the pid of a killed process spawned here (a restore needs it free)."""
    cleanup: Callable[[int], None]
    """A restored process to end with the test."""
    skip_reason: str | None = None
    close_all: list[Callable[[], None]] = field(default_factory=list)


def _fake(tmp: Path) -> CriuHarness:
    table = FakeProcessTable(kill_mode="free")
    table.add_process(1, 0, comm="init")
    pids = itertools.count(4000)

    def spawn() -> int:
        pid = next(pids)
        table.add_process(pid, 1, comm="sleep")
        return pid

    def state(pid: int) -> str:
        s = table.state(pid)
        return {PidState.RUNNING: "running", PidState.STOPPED: "stopped"}.get(s, "gone")

    return CriuHarness(FakeCriu(table), spawn, state, lambda _pid: None, lambda _pid: None)


def _real(tmp: Path) -> CriuHarness:
    path = shutil.which("criu") or ("/usr/local/sbin/criu"
                                    if os.path.exists("/usr/local/sbin/criu") else None)
    criu = CriuSwrk(path or "criu", plugin_dir=tmp / "plugins")
    reason = None
    if os.geteuid() != 0:
        reason = "real CRIU needs root"
    elif path is None:
        reason = "no criu binary on this machine"
    else:
        status = criu.status()
        if not status.ok:
            reason = f"CRIU cannot run here: {status.message}"
    children: dict[int, subprocess.Popen[bytes]] = {}
    restored: list[int] = []

    def spawn() -> int:
        proc = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        children[proc.pid] = proc
        time.sleep(0.1)
        return proc.pid

    def state(pid: int) -> str:
        try:
            code = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError):
            return "gone"
        return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(code, "running")

    def reap(pid: int) -> None:
        proc = children.pop(pid, None)
        if proc is not None:
            proc.wait(10)

    def close() -> None:
        for pid in [*children, *restored]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    harness = CriuHarness(criu, spawn, state, reap, restored.append, skip_reason=reason)
    harness.close_all.append(close)
    return harness


CRIUS: dict[str, Callable[[Path], CriuHarness]] = {"criu-swrk": _real, "fake": _fake}


@pytest.fixture(params=sorted(CRIUS))
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CriuHarness]:
    harness = CRIUS[request.param](tmp_path)
    if harness.skip_reason is not None:
        pytest.skip(harness.skip_reason)
    try:
        yield harness
    finally:
        for close in harness.close_all:
            close()


def _dirs(tmp: Path, name: str = "img") -> tuple[Path, Path]:
    images, work = tmp / name, tmp / f"{name}-work"
    images.mkdir()
    work.mkdir()
    return images, work


def _becomes(h: CriuHarness, pid: int, want: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while (got := h.state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


LIFECYCLE = ("pre_dump", "post_dump", "pre_restore", "post_restore", "post_resume")
"""The notifications these tests check the order of."""


def test_status_says_ok_with_a_version(h: CriuHarness) -> None:
    status = h.criu.status()
    assert status.ok and status.version and status.path


def test_a_dump_holds_the_tree_stopped_at_post_dump_and_leave_running_resumes_it(
    h: CriuHarness, tmp_path: Path,
) -> None:
    pid = h.spawn()
    images, work = _dirs(tmp_path)
    hooks = RecordingHooks()
    held = h.criu.dump(CriuDumpJob(pid, images, work, leave_running=True), hooks)
    assert hooks.only(*LIFECYCLE) == ["pre_dump", "post_dump"]
    assert held.pids == (pid,)
    assert h.state(pid) == "stopped"
    result = held.finish()
    assert result.pids == (pid,)
    assert _becomes(h, pid, "running") == "running"
    assert any(images.iterdir())


def test_an_abandoned_dump_runs_on_and_cannot_be_finished(h: CriuHarness, tmp_path: Path) -> None:
    pid = h.spawn()
    images, work = _dirs(tmp_path)
    held = h.criu.dump(CriuDumpJob(pid, images, work, leave_running=False, leave_stopped=True),
                       CriuHooks())
    held.abort()
    held.abort()  # idempotent
    assert _becomes(h, pid, "running") == "running"
    with pytest.raises(CriuFailed):
        held.finish()


def test_leave_stopped_leaves_it_stopped(h: CriuHarness, tmp_path: Path) -> None:
    pid = h.spawn()
    images, work = _dirs(tmp_path)
    held = h.criu.dump(CriuDumpJob(pid, images, work, leave_running=False, leave_stopped=True),
                       CriuHooks())
    held.finish()
    # CRIU sends SIGSTOP, then detaches: until the kernel delivers the stop the process can
    # read "R" for a moment (seen about 1 run in 2 on a busy machine); then it stays stopped
    assert _becomes(h, pid, "stopped") == "stopped"
    time.sleep(0.3)
    assert h.state(pid) == "stopped"


def test_a_failing_hook_aborts_the_dump_and_the_process_runs_on(
    h: CriuHarness, tmp_path: Path,
) -> None:
    pid = h.spawn()
    images, work = _dirs(tmp_path)
    with pytest.raises(CriuFailed, match="hook post_dump refuses") as info:
        h.criu.dump(CriuDumpJob(pid, images, work, leave_running=False),
                    RecordingHooks("post_dump"))
    assert isinstance(info.value.__cause__, RuntimeError) or "refuses" in str(info.value)
    assert _becomes(h, pid, "running") == "running"


def test_a_dumped_process_is_killed_then_restored_at_its_pid(
    h: CriuHarness, tmp_path: Path,
) -> None:
    pid = h.spawn()
    images, work = _dirs(tmp_path)
    h.criu.dump(CriuDumpJob(pid, images, work, leave_running=False), CriuHooks()).finish()
    assert _becomes(h, pid, "gone") == "gone"
    h.reap(pid)
    hooks = RecordingHooks()
    restored = h.criu.restore(CriuRestoreJob(images, work), hooks)
    h.cleanup(restored)
    assert restored == pid
    assert hooks.only(*LIFECYCLE) == ["pre_restore", "post_restore", "post_resume"]
    assert _becomes(h, restored, "running") == "running"


def test_a_restore_of_no_images_fails_and_leaves_nothing(h: CriuHarness, tmp_path: Path) -> None:
    images, work = _dirs(tmp_path, "empty")
    with pytest.raises(CriuFailed):
        h.criu.restore(CriuRestoreJob(images, work), CriuHooks())
