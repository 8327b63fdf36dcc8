"""The guard process (adapters/guard) on real processes: a small "daemon" (a Python process
with a ``PidfdTreeGuard``) watches a stopped ``sleep`` and is SIGKILLed; the guard, left
alone, acts within seconds. No root or CRIU needed: the job is the test's own child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.adapters.guard.client import PidfdTreeGuard, wait_for_guards
from ckptd.core.ports import GuardPhase
from ckptd.core.undo import VERSION, AbortStaging, encode

ROOT = Path(__file__).resolve().parents[3]
OP = "ck-19700101-000000-guardtest"
ENTRY = {"version": VERSION, "op": "dump", "checkpoint_id": OP,
         "undo": [encode("stage", AbortStaging(OP))]}
"""The journal entry of the dump in flight, as the recipe writes it (typed undo records)."""
GUARD_RECORD = {"step": "guard", "kind": "guard-resumed", "checkpoint_id": OP}
DAEMON = """
import os, signal, sys
from pathlib import Path
from ckptd.adapters.guard.client import PidfdTreeGuard
from ckptd.core.ports import GuardPhase
state, op, pid, start, mode, *phases = sys.argv[1:]
guard = PidfdTreeGuard(Path(state), Path(state) / "journal", traced_wait_s=1.0)
assert guard.start()
guard.watch(op, [[int(pid), int(start)]], frozenset(), mode == "leave")
for phase in phases:
    if phase == "release":
        guard.release(op)
    else:
        guard.phase(op, GuardPhase(phase))
print(guard.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def state_of(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return text[text.rindex(")") + 2]


def start_time(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: state_of(proc.pid) == "T", 5, "sleep stopped")
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / f"{OP}.json").write_text(json.dumps(ENTRY))
    return tmp_path


def kill_daemon_after(state: Path, job: subprocess.Popen[bytes], *phases: str,
                      leave: bool = False) -> int:
    """Run the "daemon" until it has told its guard ``phases``; it SIGKILLs itself then.
    Returns the guard's pid."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", DAEMON, str(state), OP, str(job.pid),
                          str(start_time(job.pid)), "leave" if leave else "stop", *phases],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert run.returncode == -signal.SIGKILL, run.stderr
    return int(run.stdout.split()[0])


def guard_gone(state: Path) -> None:
    assert wait_for_guards(state, 10.0), "the guard did not exit"


def test_daemon_killed_with_a_stopped_tree_gets_it_resumed(
    state: Path, job: subprocess.Popen[bytes],
) -> None:
    guard = kill_daemon_after(state, job)
    took = wait_until(lambda: state_of(job.pid) == "S", 5, "the tree resumed")
    print(f"resumed {took:.2f}s after the daemon's death by guard {guard}")
    guard_gone(state)
    assert json.loads((state / "journal" / f"{OP}.json").read_text()) == ENTRY


def test_daemon_killed_during_the_commit_records_then_resumes(
    state: Path, job: subprocess.Popen[bytes],
) -> None:
    kill_daemon_after(state, job, "unsure")
    wait_until(lambda: state_of(job.pid) == "S", 5, "the tree resumed")
    guard_gone(state)
    entry = json.loads((state / "journal" / f"{OP}.json").read_text())
    assert entry == {**ENTRY, "undo": [*ENTRY["undo"], GUARD_RECORD]}


def test_an_entry_the_guard_cannot_record_in_leaves_the_tree_to_the_next_start(
    state: Path, job: subprocess.Popen[bytes],
) -> None:
    legacy = {"op": "dump", "pids": [job.pid]}  # not a typed entry: no record is written
    (state / "journal" / f"{OP}.json").write_text(json.dumps(legacy))
    kill_daemon_after(state, job, "unsure")
    guard_gone(state)
    assert state_of(job.pid) == "T"
    assert json.loads((state / "journal" / f"{OP}.json").read_text()) == legacy


def test_daemon_killed_once_committed_gets_the_tree_killed(
    state: Path, job: subprocess.Popen[bytes],
) -> None:
    kill_daemon_after(state, job, "unsure", "committed")
    job.wait(timeout=5)
    assert job.returncode == -signal.SIGKILL
    guard_gone(state)


def test_a_released_dump_is_left_as_it_is(state: Path, job: subprocess.Popen[bytes]) -> None:
    kill_daemon_after(state, job, "release")
    guard_gone(state)
    assert state_of(job.pid) == "T"


def test_a_guard_that_died_is_replaced_and_told_everything(
    state: Path, job: subprocess.Popen[bytes],
) -> None:
    guard = PidfdTreeGuard(state, state / "journal", traced_wait_s=1.0)
    guard.watch(OP, [[job.pid, start_time(job.pid)]], frozenset(), False)
    first = guard.pid
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: state_of(first) in ("Z", "gone"), 5, "the guard dead")
    guard.phase(OP, GuardPhase.UNSURE)  # reaches a new guard, told the watch first
    assert guard.pid not in (0, first)
    assert state_of(job.pid) == "T"  # the first guard's death did nothing
    guard._sock.close()  # type: ignore[union-attr]  # as the daemon's death would
    wait_until(lambda: state_of(job.pid) == "S", 5, "the tree resumed")
    guard_gone(state)
    assert json.loads((state / "journal" / f"{OP}.json").read_text())["undo"][-1] == GUARD_RECORD
