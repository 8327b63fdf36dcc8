"""The dump guard's decisions (core.guard) over fakes, and their agreement with recovery.

A daemon "dies" after each step of the dump recipe; the guard (a ``TreeWatch`` fed by the
recipe's ``TreeGuard`` calls, as the guard process is) acts; then a restarted daemon recovers.
The tree must end as recovery alone would have left it — running with no checkpoint listed,
or killed with its checkpoint listed — never resumed then killed, never signalled twice over.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from signal import SIGCONT, SIGKILL

import pytest

from ckptd.core.guard import TreeWatch, Verdict, verdict
from ckptd.core.ports import GuardPhase
from ckptd.core.recipe import record_undo
from ckptd.domain import DumpRequest, PidState
from ckptd.domain.model import ROOT
from ckptd.testing import FakeClock, FakeProcessTable

from .world import JOB, JOB_TREE, guarded_world, make_world

# ---- the verdict table ------------------------------------------------------------------------


@pytest.mark.parametrize(("phase", "leave_running", "expected"), [
    (GuardPhase.STOPPED, False, Verdict.RESUME),
    (GuardPhase.STOPPED, True, Verdict.RESUME),
    (GuardPhase.UNSURE, False, Verdict.RECORD_RESUME),
    (GuardPhase.UNSURE, True, Verdict.RESUME),
    (GuardPhase.COMMITTED, False, Verdict.KILL),
    (GuardPhase.COMMITTED, True, Verdict.RESUME),  # a CUDA tree stopped for its resume
])
def test_verdict(phase: GuardPhase, leave_running: bool, expected: Verdict) -> None:
    assert verdict(phase, leave_running) is expected


# ---- TreeWatch over fake processes --------------------------------------------------------------


class Recorder:
    def __init__(self, events: list[str], ok: bool = True) -> None:
        self.events = events
        self.ok = ok
        self.calls: list[str] = []

    def __call__(self, op_id: str, what: Verdict) -> bool:
        self.calls.append(op_id)
        self.events.append(f"record {op_id} {what.value}")
        return self.ok


def stopped_tree(*pids: int) -> tuple[FakeProcessTable, list[str]]:
    events: list[str] = []
    table = FakeProcessTable(events=events)
    for n, pid in enumerate(pids):
        table.add_process(pid, pids[0] if n else 1, start_time=500 + pid)
        table.processes[pid].state = PidState.STOPPED
    return table, events


def watching(table: FakeProcessTable, pids: Sequence[int], *, phase: GuardPhase,
             leave_running: bool = False, stopped_before: frozenset[int] = frozenset(),
             record: Recorder | None = None, clock: FakeClock | None = None,
             ) -> tuple[TreeWatch, Recorder]:
    rec = record or Recorder([])
    watch = TreeWatch(traced=lambda pid: table.processes[pid].tracer != 0, record=rec,
                      clock=clock or FakeClock(), traced_wait_s=2.0)
    watch.watch("ck-1", leave_running, stopped_before)
    handles = [table.open(p, 500 + p) for p in pids]
    watch.hold("ck-1", [h for h in handles if h is not None])
    watch.phase("ck-1", phase)
    return watch, rec


def test_stopped_tree_is_resumed_except_what_was_stopped_before() -> None:
    table, _ = stopped_tree(10, 11, 12)
    table.processes[12].state = PidState.RUNNING  # not stopped (nothing to do)
    watch, rec = watching(table, (10, 11, 12), phase=GuardPhase.STOPPED,
                          stopped_before=frozenset({11}))
    done = watch.daemon_gone()
    assert table.signals == [(10, SIGCONT)]
    assert [table.state(p) for p in (10, 11, 12)] == [
        PidState.RUNNING, PidState.STOPPED, PidState.RUNNING]
    assert rec.calls == []  # nothing to record: no checkpoint can be listed
    assert "resumed [10]" in done[0]
    assert watch.watched == []


def test_unsure_commit_is_recorded_before_the_tree_is_resumed() -> None:
    table, events = stopped_tree(10, 11)
    watch, _ = watching(table, (10, 11), phase=GuardPhase.UNSURE, record=Recorder(events))
    watch.daemon_gone()
    assert events == ["record ck-1 record-resume", "signal 10 SIGCONT", "signal 11 SIGCONT"]


def test_unsure_commit_that_cannot_be_recorded_is_left_to_the_next_start() -> None:
    table, events = stopped_tree(10, 11)
    watch, _ = watching(table, (10, 11), phase=GuardPhase.UNSURE, record=Recorder(events, False))
    done = watch.daemon_gone()
    assert table.signals == []
    assert "left as it is for the next start" in done[0]


def test_unsure_leave_running_dump_is_resumed_without_record() -> None:
    table, _ = stopped_tree(10)
    watch, rec = watching(table, (10,), phase=GuardPhase.UNSURE, leave_running=True)
    watch.daemon_gone()
    assert table.signals == [(10, SIGCONT)] and rec.calls == []


def test_committed_killing_dump_is_killed() -> None:
    table, _ = stopped_tree(10, 11)
    watch, _ = watching(table, (10, 11), phase=GuardPhase.COMMITTED)
    watch.daemon_gone()
    assert table.signals == [(10, SIGKILL), (11, SIGKILL)]


def test_committed_leave_running_dump_is_continued_never_left_stopped() -> None:
    """After CRIU's end a leave-running CUDA tree is stopped until its CUDA is back
    (docs/adr/0019): the guard continues what is stopped (not what was before); a process
    that runs gets no signal."""
    table, _ = stopped_tree(10, 11, 12)
    table.processes[12].state = PidState.RUNNING
    watch, _ = watching(table, (10, 11, 12), phase=GuardPhase.COMMITTED, leave_running=True,
                        stopped_before=frozenset({11}))
    watch.daemon_gone()
    assert table.signals == [(10, SIGCONT)]
    assert [table.state(p) for p in (10, 11, 12)] == [
        PidState.RUNNING, PidState.STOPPED, PidState.RUNNING]


def test_released_dump_is_not_touched() -> None:
    table, _ = stopped_tree(10)
    watch, _ = watching(table, (10,), phase=GuardPhase.STOPPED)
    watch.release("ck-1")
    assert watch.daemon_gone() == [] and table.signals == []


def test_a_newcomer_at_a_held_pid_is_never_signalled() -> None:
    table, _ = stopped_tree(10)
    watch, _ = watching(table, (10,), phase=GuardPhase.COMMITTED)
    table.remove(10)  # the held process exits and is reaped; another gets its pid
    table.add_process(10, 1, start_time=999)
    table.processes[10].state = PidState.STOPPED
    watch.daemon_gone()
    assert table.signals == []
    assert table.state(10) is PidState.STOPPED


def test_waits_for_criu_to_let_go_before_deciding() -> None:
    table, _ = stopped_tree(10)
    table.processes[10].tracer = 4242  # CRIU still holds it
    clock = FakeClock()
    sleeps = []

    def criu_lets_go(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            table.processes[10].tracer = 0

    clock.on_sleep(criu_lets_go)
    watch, _ = watching(table, (10,), phase=GuardPhase.STOPPED, clock=clock)
    watch.daemon_gone()
    assert len(sleeps) == 3
    assert table.signals == [(10, SIGCONT)]


def test_a_tree_still_traced_is_not_resumed() -> None:
    table, _ = stopped_tree(10)
    table.processes[10].tracer = 4242
    watch, _ = watching(table, (10,), phase=GuardPhase.STOPPED)
    done = watch.daemon_gone()
    assert table.signals == []
    assert "still traced, not resumed: [10]" in done[0]


def test_handles_of_a_pid_held_twice_or_of_an_unknown_operation_are_closed() -> None:
    table, _ = stopped_tree(10)
    watch, _ = watching(table, (10,), phase=GuardPhase.STOPPED)
    again, stray = table.open(10), table.open(10)
    assert again is not None and stray is not None
    watch.hold("ck-1", [again])
    watch.hold("ck-unknown", [stray])
    assert again.closed and stray.closed
    held = watch.get("ck-1")
    assert held is not None and not held.handles[10].closed  # type: ignore[attr-defined]


# ---- the recipe tells the guard, and the guard agrees with recovery -----------------------------


def test_a_dump_tells_its_guard_each_phase_and_releases_it(tmp_path: Path) -> None:
    world, guard = guarded_world(tmp_path)
    world.service.dump(ROOT, DumpRequest(JOB))
    assert guard.calls == ["watch 3", "watch 3", "phase unsure", "phase committed", "release"]
    assert guard.watch.watched == []


def test_a_failed_commit_leaves_the_guard_unsure_until_the_rollback_ends(
    tmp_path: Path,
) -> None:
    world, guard = guarded_world(tmp_path)
    world.store.fail_commit = OSError("disk full")
    with pytest.raises(Exception, match="disk full"):
        world.service.dump(ROOT, DumpRequest(JOB))
    assert guard.calls[-3:] == ["phase unsure", "phase unsure", "release"]
    assert world.states(*JOB_TREE) == ["running"] * 3


STEPS = [s.name for s in make_world(Path("/nonexistent")).dump_recipe.steps]


@pytest.mark.parametrize("leave_running", [False, True])
@pytest.mark.parametrize("step", STEPS)
def test_guard_then_recovery_agree_after_a_crash_at_every_step(
    tmp_path: Path, step: str, leave_running: bool,
) -> None:
    world, guard = guarded_world(tmp_path)
    ctx = world.dump_recipe.new_context(ROOT, DumpRequest(JOB, leave_running=leave_running))
    for s in world.dump_recipe.steps:  # as run_steps does: each record before its step
        record_undo(s, ctx, ctx.undo_log)
        s.do(ctx)
        if s.name == step:
            break
    guard.watch.daemon_gone()  # the daemon died: the guard acts at once
    after_guard = world.states(*JOB_TREE)
    signals_by_guard = list(world.processes.signals)
    world.new_service().recover()  # later, a daemon starts again

    listed = [r.id for r in world.store.list()]
    signals = world.processes.signals
    assert list(world.journal.pending()) == []
    assert signals[: len(signals_by_guard)] == signals_by_guard
    assert not (any(s == SIGCONT for _, s in signals) and any(s == SIGKILL for _, s in signals))
    if ctx.checkpoint_id in listed and not leave_running:
        assert after_guard == ["free"] * 3  # killed at once, by the guard
        assert signals[len(signals_by_guard):] == []  # recovery found nothing left to do
    else:
        assert after_guard == ["running"] * 3  # never waits for the next start
        assert world.states(*JOB_TREE) == ["running"] * 3
        assert not any(s == SIGCONT for _, s in signals[len(signals_by_guard):])
    if STEPS.index(step) >= STEPS.index("commit"):
        assert listed == [ctx.checkpoint_id]  # committed: the guard never undoes that
    else:
        assert listed == []


def test_recovery_deletes_a_committed_checkpoint_whose_tree_the_guard_resumed(
    tmp_path: Path,
) -> None:
    world, guard = guarded_world(tmp_path)
    ctx = world.dump_recipe.new_context(ROOT, DumpRequest(JOB))
    for s in world.dump_recipe.steps:
        if s.name == "commit":  # the daemon dies inside the commit, after it is durable
            guard.phase(ctx.checkpoint_id, GuardPhase.UNSURE)
            ctx.record = world.store.commit(world.dump_recipe._record(ctx))
            break
        record_undo(s, ctx, ctx.undo_log)
        s.do(ctx)
    assert [r.id for r in world.store.list()] == [ctx.checkpoint_id]
    done = guard.watch.daemon_gone()
    assert "resumed" in done[0]
    done = world.new_service().recover()
    assert world.store.list() == []
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert not any(s == SIGKILL for _, s in world.processes.signals)
    assert f"rolled back dump {ctx.checkpoint_id}" in done[0]
