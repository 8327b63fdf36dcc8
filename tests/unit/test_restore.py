"""RestoreRecipe through CheckpointService, over the fakes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.domain import PidState, StdioFact, StdioKind
from ckptd.errors import (
    CheckpointNotFound,
    CriuFailed,
    CriuUnavailable,
    PermissionDenied,
    PidInUse,
)
from ckptd.testing import RESTORE_HOOKS

from .world import JOB, JOB_TREE, MIXED_JOB, OTHER, OTHER_JOB, USER, World

PIPE = "pipe:[424242]"


def _external_stdout(world: World, pid: int = JOB) -> None:
    world.processes.set_stdio(
        pid,
        StdioFact(pid, 0, StdioKind.DEVNULL, "/dev/null", False),
        StdioFact(pid, 1, StdioKind.PIPE, PIPE, True, PIPE),
        StdioFact(pid, 2, StdioKind.PIPE, PIPE, True, PIPE),
    )


def assert_nothing_restored(world: World) -> None:
    assert world.criu.restore_jobs == []
    assert world.stdio.calls == []
    assert world.store.open_checkouts == 0


def test_restore_by_id_recreates_the_tree(world: World) -> None:
    record = world.dump(JOB)
    assert world.states(*JOB_TREE) == ["free"] * 3
    outcome = world.restore(checkpoint_id=record.id)
    assert (outcome.checkpoint_id, outcome.pid) == (record.id, JOB)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.processes.status(JOB).ppid == 1  # not the daemon's child
    assert world.processes.status(1001).ppid == JOB
    assert outcome.output_path == ""  # no external stdio: no output file
    assert outcome.stdio == record.stdio
    assert outcome.duration_s == world.criu.restore_s
    (job,) = world.criu.restore_jobs
    assert job.images_dir == world.store.images_dir(record.id)
    assert job.inherit_fds == ()
    assert job.work_dir.parent == world.config.work_dir
    assert world.store.open_checkouts == 0
    assert [name for name, _ in world.criu.hook_calls[-5:]] == list(RESTORE_HOOKS)


def test_restore_hands_external_stdio_to_criu_and_closes_ours(world: World) -> None:
    _external_stdout(world)
    record = world.dump(JOB)
    outcome = world.restore(checkpoint_id=record.id)
    (job,) = world.criu.restore_jobs
    assert [i.key for i in job.inherit_fds] == [PIPE]
    (call,) = world.stdio.calls
    assert call[0] == record.stdio
    assert call[1].parent == world.config.output_dir
    assert call[1].name.startswith(f"{record.id}.")
    assert outcome.output_path == str(call[1])
    assert world.stdio.opened == [job.inherit_fds[0].fd]
    assert world.stdio.open_fds == []


def test_restore_output_path_from_the_request(world: World, tmp_path: Path) -> None:
    _external_stdout(world)
    record = world.dump(JOB)
    wanted = str(tmp_path / "mine.out")
    outcome = world.restore(checkpoint_id=record.id, output_path=wanted)
    assert outcome.output_path == wanted
    assert world.stdio.calls[0][1] == Path(wanted)


def test_restore_by_pid_takes_the_latest(world: World) -> None:
    world.dump(JOB, leave_running=True)
    latest = world.dump(JOB)
    world.dump(OTHER_JOB, leave_running=True)
    outcome = world.restore(pid=JOB)
    assert outcome.checkpoint_id == latest.id


def test_restore_by_name_takes_the_latest(world: World) -> None:
    """(Of one owner's: when owners share a name, root is asked for the id, issue 21.)"""
    world.dump(JOB, name="train", leave_running=True)
    latest = world.dump(JOB, name="train")
    world.dump(MIXED_JOB, name="eval", leave_running=True)
    outcome = world.restore(name="train")
    assert (outcome.checkpoint_id, outcome.pid) == (latest.id, JOB)


@pytest.mark.parametrize(
    ("request_kw", "fragment"),
    [
        ({"checkpoint_id": "ck-20200101T000000-abcdef"}, "ck-20200101T000000-abcdef"),
        ({"pid": 4321}, "no checkpoint of pid 4321"),
        ({"name": "nope"}, "no checkpoint of name 'nope'"),
        ({}, "no checkpoint named"),
    ],
)
def test_restore_of_an_unknown_checkpoint(
    world: World, request_kw: dict[str, object], fragment: str
) -> None:
    world.dump(JOB, name="train")
    with pytest.raises(CheckpointNotFound) as info:
        world.restore(**request_kw)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert_nothing_restored(world)


def test_restore_by_another_uid_is_denied(world: World) -> None:
    record = world.dump(JOB)
    with pytest.raises(PermissionDenied) as info:
        world.restore(OTHER, checkpoint_id=record.id)
    assert info.value.checkpoint_id == record.id
    assert "uid 2000" in str(info.value)
    assert_nothing_restored(world)
    assert world.restore(USER, checkpoint_id=record.id).pid == JOB


def test_restore_when_criu_is_unavailable(world: World) -> None:
    record = world.dump(JOB)
    world.criu.set_status(False, "CRIU 3.19 is too old")
    with pytest.raises(CriuUnavailable) as info:
        world.restore(checkpoint_id=record.id)
    assert "too old" in str(info.value)
    assert info.value.checkpoint_id == record.id
    assert_nothing_restored(world)


def test_pid_in_use_by_a_running_process(world: World) -> None:
    record = world.dump(JOB)
    world.processes.add_process(1001, 77, comm="intruder")
    with pytest.raises(PidInUse) as info:
        world.restore(checkpoint_id=record.id)
    assert info.value.pid == 1001
    assert info.value.checkpoint_id == record.id
    text = str(info.value)
    assert "pid 1001 is in use" in text
    assert "intruder" in text
    assert "\n" not in text
    assert_nothing_restored(world)
    assert world.clock.sleeps == []
    assert world.states(*JOB_TREE) == ["free", "running", "free"]


def test_pid_in_use_by_the_dumped_tree_itself(world: World) -> None:
    record = world.dump(JOB, leave_running=True)
    with pytest.raises(PidInUse) as info:
        world.restore(checkpoint_id=record.id)
    assert info.value.pid == JOB
    assert_nothing_restored(world)


def test_a_zombie_reaped_within_the_wait_is_waited_for(world: World) -> None:
    record = world.dump(JOB)
    world.processes.add_process(1002, 77, comm="job-child", state=PidState.ZOMBIE)
    world.processes.reap_after(world.clock, 1002, sleeps=3)
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.pid == JOB
    assert len(world.clock.sleeps) == 3
    assert sum(world.clock.sleeps) < world.config.zombie_wait_s
    assert world.states(*JOB_TREE) == ["running"] * 3


def _fail_after_sleeping(world: World, seconds: float) -> None:
    """Make a wait that never gives up fail fast instead of hanging the suite."""
    start = world.clock.monotonic()

    def guard(_: float) -> None:
        if world.clock.monotonic() - start > seconds:
            raise AssertionError(f"still waiting after {seconds} fake seconds")

    world.clock.on_sleep(guard)


def test_a_zombie_never_reaped_is_pid_in_use_naming_its_parent(world: World) -> None:
    record = world.dump(JOB)
    world.processes.add_process(1002, 77, comm="job-child", state=PidState.ZOMBIE)
    _fail_after_sleeping(world, 10 * world.config.zombie_wait_s)
    start = world.clock.monotonic()
    with pytest.raises(PidInUse) as info:
        world.restore(checkpoint_id=record.id)
    waited = world.clock.monotonic() - start
    assert world.config.zombie_wait_s <= waited < world.config.zombie_wait_s + 1.5
    assert info.value.pid == 1002
    text = str(info.value)
    assert "pid 1002 is still held by a zombie" in text
    assert "parent pid 77" in text
    assert "make pid 77 reap its child" in text
    assert_nothing_restored(world)


def test_criu_restore_failure_closes_stdio_and_names_the_checkpoint(world: World) -> None:
    _external_stdout(world)
    record = world.dump(JOB)
    injected = CriuFailed("CRIU restore failed: boom")
    world.criu.fail_restore = injected
    with pytest.raises(CriuFailed) as info:
        world.restore(checkpoint_id=record.id)
    assert info.value is injected
    assert info.value.checkpoint_id == record.id
    assert info.value.pid == JOB
    assert len(world.stdio.opened) == 1
    assert world.stdio.open_fds == []
    with pytest.raises(OSError):
        os.fstat(world.stdio.opened[0])
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert world.store.open_checkouts == 0
    assert [r.id for r in world.store.list()] == [record.id]  # the checkpoint is kept


@pytest.mark.parametrize("hook", RESTORE_HOOKS)
def test_a_raising_restore_hook_leaves_nothing(world: World, hook: str) -> None:
    record = world.dump(JOB)

    def explode(pid: int) -> None:
        raise RuntimeError("no namespaces for you")

    world.hooks.on[hook] = explode
    with pytest.raises(CriuFailed) as info:
        world.restore(checkpoint_id=record.id)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.checkpoint_id == record.id
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert world.store.open_checkouts == 0


def test_restore_reports_progress_and_releases_the_pid_lock(world: World) -> None:
    record = world.dump(JOB)
    world.progress.clear()
    world.restore(checkpoint_id=record.id)
    assert [stage for stage, _ in world.progress] == [
        "resolve", "compat", "pids", "cgroup", "checkout", "stdio", "files", "paths",
        "criu-restore", "gate",
        "gpu-restore",
        "done",
    ]
    assert [f for _, f in world.progress] == sorted(f for _, f in world.progress)
    world.dump(JOB)  # the pid lock taken by the restore was released


def test_restore_of_a_tree_with_another_uids_process_is_denied(world: World) -> None:
    record = world.dump(MIXED_JOB)  # root may dump it
    assert record.uid == USER.uid
    with pytest.raises(PermissionDenied):
        world.restore(USER, checkpoint_id=record.id)
    assert world.criu.restore_jobs == []
