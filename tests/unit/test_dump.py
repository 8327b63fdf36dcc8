"""DumpRecipe through CheckpointService, over the fakes: refusals, failures and their rollback,
success paths."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from ckptd.core.ports import CriuDumpJob
from ckptd.core.undo import AbortStaging, KillTree, ResumeTree, decode_entry
from ckptd.domain import Caller, CheckpointRecord, DumpRequest, PidState, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import (
    Busy,
    CkptdError,
    CriuFailed,
    CriuUnavailable,
    InvalidTarget,
    PermissionDenied,
    ProcessNotFound,
    StoreError,
    TargetRefused,
)
from ckptd.testing import DUMP_HOOKS

from .world import (
    DAEMON_PARENT,
    DAEMON_PID,
    JOB,
    JOB_TREE,
    MIXED_JOB,
    OTHER,
    OTHER_JOB,
    USER,
    World,
    assert_nothing_happened,
)

SIGKILL, SIGCONT = int(signal.SIGKILL), int(signal.SIGCONT)


def assert_rolled_back(w: World, exc: CkptdError) -> None:
    """A failed dump leaves nothing listed, no staging, no journal entry, nothing killed."""
    assert exc.checkpoint_id is not None
    assert exc.pid == JOB
    assert w.store.list() == []
    assert w.store.staged() == []
    assert not w.store.staging_dir(exc.checkpoint_id).parent.exists()
    assert list(w.journal.pending()) == []
    assert ("begin", exc.checkpoint_id) in w.journal.history
    assert ("abort", exc.checkpoint_id) in w.store.calls
    assert all(signo != SIGKILL for _pid, signo in w.processes.signals)


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pid", "caller", "error", "fragment"),
    [
        pytest.param(9999, ROOT, ProcessNotFound, "no process with pid 9999", id="nonexistent"),
        pytest.param(1, ROOT, TargetRefused, "pid 1 (init)", id="pid-1"),
        pytest.param(0, ROOT, InvalidTarget, "invalid pid 0", id="pid-0"),
        pytest.param(-7, ROOT, InvalidTarget, "invalid pid -7", id="pid-negative"),
        pytest.param(2, ROOT, TargetRefused, "kernel thread", id="kthreadd"),
        pytest.param(3, ROOT, TargetRefused, "kernel thread", id="kworker"),
        pytest.param(DAEMON_PID, ROOT, TargetRefused, "ckptd daemon", id="daemon"),
        pytest.param(DAEMON_PARENT, ROOT, TargetRefused, "ancestors", id="daemon-ancestor"),
        pytest.param(OTHER_JOB, USER, PermissionDenied, "belongs to uid 2000", id="other-uid"),
        pytest.param(
            MIXED_JOB, USER, PermissionDenied, "process 3001 (helper)", id="other-uid-child"
        ),
        pytest.param(JOB, OTHER, PermissionDenied, "the caller is uid 2000", id="user-on-user"),
    ],
)
def test_dump_refused(
    world: World, pid: int, caller: Caller, error: type[CkptdError], fragment: str
) -> None:
    with pytest.raises(error) as info:
        world.dump(pid, caller)
    assert type(info.value) is error
    assert fragment in str(info.value)
    assert info.value.pid == pid
    assert info.value.hint
    assert str(info.value).endswith(info.value.hint)
    assert "\n" not in str(info.value)
    assert_nothing_happened(world)


def test_dump_of_a_zombie_is_refused_naming_its_parent(world: World) -> None:
    world.processes.add_process(4000, DAEMON_PARENT, comm="defunct", state=PidState.ZOMBIE)
    with pytest.raises(TargetRefused) as info:
        world.dump(4000)
    assert "zombie" in str(info.value)
    assert f"parent {DAEMON_PARENT}" in str(info.value)
    assert_nothing_happened(world)


def test_a_job_in_session_zero_is_refused_before_criu_with_the_way_out(world: World) -> None:
    """CRIU cannot dump a task whose session leader is outside its pid namespace (getsid
    says 0): the job was started by a launcher that never called setsid."""
    world.processes.add_process(4001, DAEMON_PARENT, comm="orphan-sid", session=0)
    with pytest.raises(TargetRefused) as info:
        world.dump(4001)
    assert "pid 4001 (orphan-sid) is in session 0" in str(info.value)
    assert "setsid" in str(info.value)
    assert_nothing_happened(world)


def test_a_user_may_dump_its_own_tree(world: World) -> None:
    record = world.dump(JOB, USER, leave_running=True)
    assert record.uid == USER.uid
    assert [r.id for r in world.store.list()] == [record.id]


@pytest.mark.parametrize("pid", [OTHER_JOB, MIXED_JOB])
def test_root_may_dump_any_uid(world: World, pid: int) -> None:
    record = world.dump(pid, ROOT, leave_running=True)
    assert record.uid == world.processes.status(pid).uid


def test_criu_unavailable_refuses_before_anything(world: World) -> None:
    world.criu.set_status(False, "`criu check` failed: seccomp missing")
    with pytest.raises(CriuUnavailable) as info:
        world.dump(JOB)
    assert "seccomp missing" in str(info.value)
    assert info.value.pid == JOB
    assert_nothing_happened(world)
    assert world.states(*JOB_TREE) == ["running"] * 3


# ---- busy -------------------------------------------------------------------------------------


def test_two_dumps_of_the_same_pid_at_once_busy(world: World) -> None:
    earlier = world.dump(JOB, leave_running=True)
    entered, release = threading.Event(), threading.Event()

    def block(pid: int) -> None:
        if pid == JOB:
            entered.set()
            assert release.wait(10)

    world.hooks.on["pre_dump"] = block
    outcome: dict[str, Any] = {}

    def first_dump() -> None:
        try:
            outcome["record"] = world.service.dump(ROOT, DumpRequest(JOB, leave_running=True))
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=first_dump)
    thread.start()
    try:
        assert entered.wait(10)
        with pytest.raises(Busy) as info:
            world.service.dump(ROOT, DumpRequest(JOB))
        assert info.value.pid == JOB
        assert f"pid {JOB} is busy: a checkpoint is in progress" in str(info.value)
        with pytest.raises(Busy):
            world.service.restore(ROOT, RestoreRequest(checkpoint_id=earlier.id))
        # another pid is not blocked by this one
        other = world.service.dump(ROOT, DumpRequest(OTHER_JOB, leave_running=True))
        assert other.pid == OTHER_JOB
    finally:
        release.set()
        thread.join(10)
    assert "error" not in outcome
    assert outcome["record"].pid == JOB
    assert [j.pid for j in world.criu.dump_jobs] == [JOB, JOB, OTHER_JOB]
    assert world.criu.restore_jobs == []
    # the lock was released
    del world.hooks.on["pre_dump"]
    world.dump(JOB, leave_running=True)
    assert len(world.store.list()) == 4


# ---- CRIU failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("leave_running", [False, True])
@pytest.mark.parametrize("fail_after", ["", *DUMP_HOOKS])
def test_criu_dump_failure_rolls_back(world: World, fail_after: str, leave_running: bool) -> None:
    injected = CriuFailed("CRIU dump of pid 1000 failed: boom", log_tail="Error (x.c:1): boom")
    world.criu.fail_dump = injected
    world.criu.fail_dump_after = fail_after
    with pytest.raises(CriuFailed) as info:
        world.dump(JOB, leave_running=leave_running)
    assert info.value is injected
    assert_rolled_back(world, info.value)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.processes.signals == []  # CRIU left the tree running: nothing to resume
    assert world.criu.dump_jobs[0].leave_stopped is (not leave_running)


@pytest.mark.parametrize("hook", DUMP_HOOKS)
def test_a_raising_hook_aborts_the_dump(world: World, hook: str) -> None:
    def explode(pid: int) -> None:
        raise RuntimeError(f"hook refused pid {pid}")

    world.hooks.on[hook] = explode
    with pytest.raises(CriuFailed) as info:
        world.dump(JOB)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "hook refused pid 1000" in str(info.value)
    assert_rolled_back(world, info.value)
    assert world.states(*JOB_TREE) == ["running"] * 3
    called = [name for name, _pid in world.criu.hook_calls]
    assert called == list(DUMP_HOOKS[: DUMP_HOOKS.index(hook) + 1])


# ---- commit failure ---------------------------------------------------------------------------


def test_commit_failure_resumes_the_stopped_tree_and_kills_nothing(world: World) -> None:
    injected = StoreError("cannot commit: disk full", hint="free some space")
    world.store.fail_commit = injected
    with pytest.raises(StoreError) as info:
        world.dump(JOB)
    assert info.value is injected
    assert_rolled_back(world, info.value)
    assert world.states(*JOB_TREE) == ["running"] * 3
    for pid in JOB_TREE:
        assert world.processes.signals_to(pid) == [SIGCONT]


def test_commit_failure_with_leave_running_sends_nothing(world: World) -> None:
    world.store.fail_commit = StoreError("cannot commit: disk full")
    with pytest.raises(StoreError) as info:
        world.dump(JOB, leave_running=True)
    assert_rolled_back(world, info.value)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.processes.signals == []


def test_a_process_stopped_before_the_dump_stays_stopped_on_rollback(world: World) -> None:
    world.processes.processes[1001].state = PidState.STOPPED
    world.store.fail_commit = StoreError("cannot commit: disk full")
    with pytest.raises(StoreError) as info:
        world.dump(JOB)
    assert_rolled_back(world, info.value)
    assert world.states(*JOB_TREE) == ["running", "stopped", "running"]
    assert world.processes.signals_to(1001) == []
    assert world.processes.signals_to(1000) == [SIGCONT]
    assert world.processes.signals_to(1002) == [SIGCONT]
    facts = world.journal.history
    assert facts[0][0] == "begin"


def test_stopped_before_is_journaled(world: World) -> None:
    world.processes.processes[1002].state = PidState.STOPPED
    seen: list[dict[str, Any]] = []
    world.hooks.on["post_dump"] = lambda pid: seen.extend(f for _op, f in world.journal.pending())
    starts = {p: world.processes.processes[p].start_time for p in JOB_TREE}
    record = world.dump(JOB)
    (entry,) = [decode_entry(facts) for facts in seen]
    assert (entry.op, entry.checkpoint_id) == ("dump", record.id)
    assert entry.undos == (
        AbortStaging(record.id),
        ResumeTree(tuple((p, starts[p]) for p in JOB_TREE), (1002,), unless_committed=record.id),
    )


def test_a_process_stopped_before_a_failed_criu_dump_stays_stopped(world: World) -> None:
    world.processes.processes[1001].state = PidState.STOPPED
    world.criu.fail_dump = CriuFailed("CRIU dump failed: boom")
    with pytest.raises(CriuFailed):
        world.dump(JOB)
    assert world.states(*JOB_TREE) == ["running", "stopped", "running"]
    assert world.processes.signals == []


# ---- success ----------------------------------------------------------------------------------


def test_leave_running_keeps_the_tree_running_and_lists_it(world: World) -> None:
    record = world.dump(JOB, leave_running=True)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.processes.signals == []
    assert world.store.list() == [world.store.get(record.id)]
    assert record.leave_running is True
    assert list(world.journal.pending()) == []
    job = world.criu.dump_jobs[0]
    assert (job.leave_running, job.leave_stopped) == (True, False)


def test_default_dump_kills_the_tree_only_after_commit(world: World) -> None:
    states_at_commit: list[list[str]] = []
    journal_at_commit: list[dict[str, Any]] = []
    commit = world.store.commit

    def spy(record: CheckpointRecord) -> CheckpointRecord:
        states_at_commit.append(world.states(*JOB_TREE))
        journal_at_commit.extend(facts for _op, facts in world.journal.pending())
        return commit(record)

    world.store.commit = spy  # type: ignore[method-assign]
    record = world.dump(JOB)
    ckpt = record.id
    events = world.events

    def first(event: str) -> int:
        return events.index(event)

    def last(event: str) -> int:
        return len(events) - 1 - events[::-1].index(event)

    kills = [i for i, e in enumerate(events) if e.endswith(" SIGKILL")]
    assert [events[i] for i in kills] == [f"signal {pid} SIGKILL" for pid in JOB_TREE]
    assert first(f"journal.begin {ckpt}") < first(f"store.begin {ckpt}")
    assert first(f"store.begin {ckpt}") < first(f"criu.dump {JOB}") < first(f"criu.dumped {JOB}")
    assert first(f"criu.dumped {JOB}") < first(f"store.commit {ckpt}") < kills[0]
    assert kills[-1] < last(f"journal.end {ckpt}")
    assert [e for e in events if e.startswith("signal")] == [events[i] for i in kills]
    assert states_at_commit == [["stopped"] * 3]  # left stopped by CRIU, not killed
    (entry,) = [decode_entry(facts) for facts in journal_at_commit]
    assert [u.kind for u in entry.undos] == ["abort-staging", "resume-tree", "kill-tree"]
    assert [[p for p, _ in u.members] for u in entry.undos[1:]  # type: ignore[union-attr]
            ] == [list(JOB_TREE)] * 2
    assert world.states(*JOB_TREE) == ["free"] * 3
    job: CriuDumpJob = world.criu.dump_jobs[0]
    assert (job.leave_running, job.leave_stopped) == (False, True)
    assert job.images_dir == world.store.staging_dir(ckpt)
    assert job.work_dir == world.config.work_dir / ckpt
    assert [r.id for r in world.store.list()] == [ckpt]
    assert list(world.journal.pending()) == []


def test_record_facts(world: World) -> None:
    first = world.dump(JOB, USER, name="train", labels={"step": "1"}, leave_running=True)
    created = world.clock.time() + 1.0
    second = world.dump(JOB, USER, name="train", labels={"step": "2"})
    assert (second.pid, second.name, dict(second.labels), second.uid) == (
        JOB, "train", {"step": "2"}, USER.uid,
    )
    assert second.created == created
    assert second.node == "test-node"
    assert second.criu_version == "4.1"
    assert second.leave_running is False
    assert [p.pid for p in second.processes] == list(JOB_TREE)
    assert [p.ppid for p in second.processes] == [1, JOB, JOB]
    assert {p.comm for p in second.processes} == {"job", "job-child"}
    assert second.frozen_s == world.criu.frozen_s
    assert second.bytes > 0
    assert len(second.stdio) == 9
    assert first.parent_id == ""
    assert second.parent_id == first.id
    assert second.id > first.id


def test_parent_is_the_latest_checkpoint_of_the_same_pid_only(world: World) -> None:
    first = world.dump(JOB, leave_running=True)
    other = world.dump(OTHER_JOB, leave_running=True)
    second = world.dump(JOB, leave_running=True)
    third = world.dump(JOB, leave_running=True)
    assert other.parent_id == ""
    assert (second.parent_id, third.parent_id) == (first.id, second.id)


def test_progress_reports_every_step_in_order(world: World) -> None:
    world.dump(JOB)
    assert [stage for stage, _ in world.progress] == [
        "inspect", "journal", "stage", "precopy", "gpu-lock", "gpu-checkpoint", "criu-dump",
        "files", "let-go",
        "gate", "commit", "gpu-resume", "criu-finish", "release", "done",
    ]
    fractions = [f for _, f in world.progress]
    assert fractions == sorted(fractions)
    assert fractions[0] == 0.0
    assert fractions[-1] == 1.0


def test_work_dirs_are_pruned_to_keep_work_dirs(tmp_path: Any) -> None:
    from .world import make_world

    w = make_world(tmp_path, keep_work_dirs=2)
    records = [w.dump(JOB, leave_running=True) for _ in range(4)]
    kept = sorted(p.name for p in w.config.work_dir.iterdir())
    assert len(kept) == 2
    assert set(kept) <= {r.id for r in records}
    assert all((w.config.work_dir / k / "dump.log").is_file() for k in kept)


# ---- bugs -------------------------------------------------------------------------------------


def test_the_stored_record_is_the_returned_record(world: World) -> None:
    record = world.dump(JOB)
    assert record.duration_s > 0
    assert world.service.get(ROOT, record.id) == record


def _fork_before_seize(world: World) -> None:
    def fork(pid: int) -> None:
        if 1003 not in world.processes.processes:
            world.processes.add_process(1003, pid, comm="job-child", uid=USER.uid)

    world.hooks.on["pre_dump"] = fork


def test_a_child_forked_during_the_dump_is_recorded_and_released(world: World) -> None:
    _fork_before_seize(world)
    record = world.dump(JOB)
    assert [p.pid for p in record.processes] == [*JOB_TREE, 1003]
    assert world.states(*JOB_TREE, 1003) == ["free"] * 4


def test_a_child_forked_during_a_failed_dump_is_resumed(world: World) -> None:
    _fork_before_seize(world)
    world.store.fail_commit = StoreError("cannot commit: disk full")
    with pytest.raises(StoreError):
        world.dump(JOB)
    assert world.states(*JOB_TREE, 1003) == ["running"] * 4
    assert world.processes.signals_to(1003) == [SIGCONT]


def test_the_journal_has_the_dumped_pids_before_commit(world: World) -> None:
    """So that a daemon killed during commit kills or resumes the forked child too."""
    _fork_before_seize(world)
    journaled: list[list[int]] = []
    commit = world.store.commit

    def spy(record: CheckpointRecord) -> CheckpointRecord:
        for _op, facts in world.journal.pending():
            for undo in decode_entry(facts).undos:
                if isinstance(undo, ResumeTree | KillTree):
                    journaled.append([p for p, _ in undo.members])
        return commit(record)

    world.store.commit = spy  # type: ignore[method-assign]
    world.dump(JOB)
    assert journaled == [[*JOB_TREE, 1003]] * 2  # resumed if not committed, else killed


def test_a_foreign_child_forked_during_a_users_dump_is_refused(world: World) -> None:
    def fork_root_child(pid: int) -> None:
        if 1003 not in world.processes.processes:
            world.processes.add_process(1003, pid, comm="su", uid=0)

    world.hooks.on["pre_dump"] = fork_root_child
    with pytest.raises(PermissionDenied):
        world.dump(JOB, USER)
    assert world.store.list() == []
    assert world.states(*JOB_TREE, 1003) == ["running"] * 4


def test_a_lock_the_restore_will_drop_is_recorded_as_not_captured(world: World) -> None:
    """Issue 34, 8: what ``Criu.lost_locks`` finds in the images (SQLite WAL's -shm lock)
    is said with the checkpoint, beside the files not captured, and the dump goes on."""
    lost = ("/srv/job/db-shm: the POSIX read lock pid 1000 holds on bytes 128-128 is not "
            "restored (...)",)
    world.criu.locks_lost = lost
    record = world.dump(JOB, leave_running=True)
    assert record.files_skipped == lost
    assert world.service.get(ROOT, record.id).files_skipped == lost
    world.criu.locks_lost = ()
    assert world.dump(JOB, leave_running=True).files_skipped == ()
