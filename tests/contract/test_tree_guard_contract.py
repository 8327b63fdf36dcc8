"""Contract of ``TreeGuard`` (docs/adr/0016): ``PidfdTreeGuard`` (a guard process, told by a
small "daemon" process that is then SIGKILLed, acting on a stopped ``sleep``) and
``FakeTreeGuard`` (the same ``TreeWatch`` in this process over a ``FakeProcessTable``) do the
same once the daemon is dead: a dump that had not committed gets its tree resumed; one whose
commit was under way gets ``GuardResumed`` recorded first (or, with an entry it cannot record
in, nothing done); a committed killing dump gets its tree killed; a committed leave-running
one, continued; a released one, nothing. No root needed: the job is the test's own child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from ckptd.adapters.guard.client import wait_for_guards
from ckptd.core.ports import GuardPhase
from ckptd.core.undo import VERSION, AbortStaging, encode
from ckptd.domain import PidState
from ckptd.testing import FakeClock, FakeProcessTable, FakeTreeGuard, MemoryJournal

ROOT = Path(__file__).resolve().parents[2]
OP = "ck-19700101-000000-guardcontract"
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
os.kill(os.getpid(), signal.SIGKILL)
"""


class Harness(Protocol):
    """One guard implementation, a stopped job it can be told of, and its journal."""

    def write_entry(self, entry: dict[str, Any]) -> None: ...

    def die_after(self, phases: tuple[str, ...], leave_running: bool) -> None:
        """Watch the job, tell ``phases`` ("release" or a ``GuardPhase`` value), then the
        daemon dies; returns once the guard has acted."""
        ...

    def state(self) -> str:
        """The job: "stopped", "running" or "dead"."""
        ...

    def entry(self) -> dict[str, Any]: ...


def _wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class RealGuard:
    def __init__(self, tmp: Path) -> None:
        self.state_dir = tmp
        (tmp / "journal").mkdir()
        self.job = subprocess.Popen(["sleep", "60"])
        os.kill(self.job.pid, signal.SIGSTOP)
        assert _wait_until(lambda: self.state() == "stopped", 5)

    def _stat(self) -> str:
        try:
            text = Path(f"/proc/{self.job.pid}/stat").read_text()
        except FileNotFoundError:
            return ""
        return text[text.rindex(")") + 2:]

    def write_entry(self, entry: dict[str, Any]) -> None:
        (self.state_dir / "journal" / f"{OP}.json").write_text(json.dumps(entry))

    def die_after(self, phases: tuple[str, ...], leave_running: bool) -> None:
        start = self._stat().split()[19]
        run = subprocess.run(
            [sys.executable, "-c", DAEMON, str(self.state_dir), OP, str(self.job.pid), start,
             "leave" if leave_running else "stop", *phases],
            capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == -signal.SIGKILL, run.stderr
        assert wait_for_guards(self.state_dir, 10.0), "the guard did not exit"

    def state(self) -> str:
        stat = self._stat()
        return {"T": "stopped", "t": "stopped", "Z": "dead", "": "dead"}.get(stat[:1], "running")

    def entry(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.state_dir / "journal" / f"{OP}.json").read_text())
        return data

    def close(self) -> None:
        self.job.kill()
        self.job.wait()


class FakeGuard:
    PID = 4321

    def __init__(self) -> None:
        self.processes = FakeProcessTable()
        self.processes.add_process(self.PID, 1, start_time=777)
        self.processes.processes[self.PID].state = PidState.STOPPED
        self.journal = MemoryJournal()
        self.guard = FakeTreeGuard(self.processes, self.journal, FakeClock())

    def write_entry(self, entry: dict[str, Any]) -> None:
        self.journal.begin(OP, entry)

    def die_after(self, phases: tuple[str, ...], leave_running: bool) -> None:
        self.guard.watch(OP, [[self.PID, 777]], frozenset(), leave_running)
        for phase in phases:
            if phase == "release":
                self.guard.release(OP)
            else:
                self.guard.phase(OP, GuardPhase(phase))
        self.guard.daemon_gone()

    def state(self) -> str:
        return {PidState.STOPPED: "stopped", PidState.FREE: "dead",
                PidState.ZOMBIE: "dead"}.get(self.processes.status(self.PID).state, "running")

    def entry(self) -> dict[str, Any]:
        return dict(self.journal.pending())[OP]

    def close(self) -> None:
        pass


@pytest.fixture(params=["real", "fake"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    made = RealGuard(tmp_path) if request.param == "real" else FakeGuard()
    made.write_entry(ENTRY)
    try:
        yield made
    finally:
        made.close()


def _eventually(harness: Harness, state: str) -> str:
    _wait_until(lambda: harness.state() == state, 5)
    return harness.state()


def test_a_dump_not_committed_gets_its_tree_resumed(harness: Harness) -> None:
    harness.die_after((), leave_running=False)
    assert _eventually(harness, "running") == "running"
    assert harness.entry() == ENTRY


def test_a_commit_under_way_is_recorded_then_the_tree_resumed(harness: Harness) -> None:
    harness.die_after(("unsure",), leave_running=False)
    assert _eventually(harness, "running") == "running"
    assert harness.entry() == {**ENTRY, "undo": [*ENTRY["undo"], GUARD_RECORD]}


def test_an_entry_it_cannot_record_in_leaves_the_tree_to_the_next_start(
    harness: Harness,
) -> None:
    legacy = {"op": "dump", "pids": [1]}  # not a typed entry: no record can be written
    harness.write_entry(legacy)
    harness.die_after(("unsure",), leave_running=False)
    assert harness.state() == "stopped"
    assert harness.entry() == legacy


def test_a_committed_killing_dump_gets_its_tree_killed(harness: Harness) -> None:
    harness.die_after(("unsure", "committed"), leave_running=False)
    assert _eventually(harness, "dead") == "dead"


def test_a_committed_leave_running_dump_gets_its_tree_continued(harness: Harness) -> None:
    harness.die_after(("unsure", "committed"), leave_running=True)
    assert _eventually(harness, "running") == "running"
    assert harness.entry() == ENTRY  # nothing to record: the tree runs on either way


def test_a_released_dump_is_left_as_it_is(harness: Harness) -> None:
    harness.die_after(("release",), leave_running=False)
    assert harness.state() == "stopped"
    assert harness.entry() == ENTRY
