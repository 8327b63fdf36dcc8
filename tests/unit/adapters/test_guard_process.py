"""The guard process (adapters/guard) on real processes, beyond the ``TreeGuard`` contract
(tests/contract/test_tree_guard_contract.py: what a guard does once its daemon is dead): a
guard that dies while the daemon lives is replaced and told everything in flight. No root or
CRIU needed: the job is the test's own child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.adapters.guard.client import PidfdTreeGuard, wait_for_guards
from ckptd.core.ports import GuardPhase
from ckptd.core.undo import VERSION, AbortStaging, encode

OP = "ck-19700101-000000-guardtest"
ENTRY = {"version": VERSION, "op": "dump", "checkpoint_id": OP,
         "undo": [encode("stage", AbortStaging(OP))]}
"""The journal entry of the dump in flight, as the recipe writes it (typed undo records)."""
GUARD_RECORD = {"step": "guard", "kind": "guard-resumed", "checkpoint_id": OP}


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


def guard_gone(state: Path) -> None:
    assert wait_for_guards(state, 10.0), "the guard did not exit"


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
