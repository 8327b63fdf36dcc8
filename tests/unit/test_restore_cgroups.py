"""Where a restored tree lives (docs/adr/0010), over the fakes: in the caller's cgroup; in a
cgroup of its own when the daemon asks (or the caller is in the daemon's cgroup); born there
(CRIU is placed before it creates anything), checked at post-restore before it runs; a tree
that cannot be placed is undone, nothing of it left."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.placement import leaf_name, within
from ckptd.domain import Caller, EventKind, PidState
from ckptd.domain.model import ROOT
from ckptd.errors import CgroupUnavailable
from ckptd.testing import FakeCgroups

from .world import (
    DAEMON_CGROUP,
    DAEMON_PARENT,
    DAEMON_PID,
    JOB,
    JOB_TREE,
    USER,
    USER_CGROUP,
    World,
    make_world,
)

CRIU_PID = 900001  # FakeCriu's first own pid


def _seen_at_post_restore(world: World) -> dict[int, tuple[str, PidState]]:
    """Record each process's cgroup and state when CRIU says post-restore."""
    seen: dict[int, tuple[str, PidState]] = {}

    def look(pid: int) -> None:
        del pid
        for p in JOB_TREE:
            seen[p] = (world.cgroups.cgroup_of(p), world.processes.status(p).state)

    world.hooks.on["post_restore"] = look
    return seen


def _nothing_left(world: World) -> None:
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert world.store.open_checkouts == 0
    assert world.stdio.open_fds == []


def test_a_callers_restore_is_born_in_the_callers_cgroup_before_it_runs(world: World) -> None:
    record = world.dump(JOB)
    seen = _seen_at_post_restore(world)
    outcome = world.restore(USER, checkpoint_id=record.id)

    assert outcome.cgroup == USER_CGROUP
    assert seen == {p: (USER_CGROUP, PidState.STOPPED) for p in JOB_TREE}, "before it ran"
    assert world.cgroups.members(USER_CGROUP) == sorted([*JOB_TREE, USER.pid or 0])
    assert world.cgroups.members(DAEMON_CGROUP) == sorted(
        p for p in world.processes.processes if p not in JOB_TREE)
    (job,) = world.criu.restore_jobs
    assert job.restore_cgroups is False, "CRIU leaves cgroups alone (no dumped paths remade)"
    # CRIU itself went there before it created anything (its memory work is charged there)
    events = world.events
    assert events.index(f"cgroups.move {USER_CGROUP} {CRIU_PID}") < events.index(
        "criu.hook pre_restore")
    assert world.cgroups.moves == [((CRIU_PID,), USER_CGROUP)], "nothing else to move"
    assert not any(c.startswith("/ckptd-jobs") for c in world.cgroups.cgroups)


@pytest.mark.parametrize(
    "caller",
    [ROOT, Caller(uid=0, pid=DAEMON_PID), Caller(uid=0, pid=0), Caller(uid=1000),
     Caller(uid=0, pid=DAEMON_PARENT)],
    ids=["no-pid", "the-daemon", "pid-0", "resume-of-a-users-job", "in-the-daemons-cgroup"],
)
def test_the_daemons_own_restores_get_a_cgroup_of_their_own(
    world: World, caller: Caller
) -> None:
    """Resume, drain/resume, resume_drained_on_start and a migration's target restore ask
    with no caller pid; a caller in the daemon's cgroup is treated alike: a daemon restart
    must never touch the tree."""
    record = world.dump(JOB, name="train")
    seen = _seen_at_post_restore(world)
    outcome = world.restore(caller, checkpoint_id=record.id)

    assert outcome.cgroup.startswith("/ckptd-jobs/train-r")
    assert seen == {p: (outcome.cgroup, PidState.STOPPED) for p in JOB_TREE}
    assert world.cgroups.members(outcome.cgroup) == list(JOB_TREE)
    assert not set(JOB_TREE) & set(world.cgroups.members(DAEMON_CGROUP))
    assert f"in cgroup {outcome.cgroup}" in world.service.events.recent(1)[0].message


def test_a_checkpoint_without_a_name_gets_a_cgroup_named_by_its_id(world: World) -> None:
    record = world.dump(JOB)
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.cgroup.startswith(f"/ckptd-jobs/{record.id}-r")


def test_empty_cgroups_of_ended_trees_are_removed_before_a_new_one_is_made(
    world: World,
) -> None:
    world.cgroups.add("/ckptd-jobs/old-r00000001")  # its tree has ended
    world.cgroups.place(2001, "/ckptd-jobs/busy-r00000002")  # its tree runs on
    record = world.dump(JOB)
    outcome = world.restore(checkpoint_id=record.id)
    under = sorted(c for c in world.cgroups.cgroups if c.startswith("/ckptd-jobs/"))
    assert under == sorted(["/ckptd-jobs/busy-r00000002", outcome.cgroup])
    assert "cgroups.removed /ckptd-jobs/old-r00000001" in world.events


def test_an_empty_jobs_cgroup_keeps_the_daemons_restores_in_its_cgroup(tmp_path: Path) -> None:
    world = make_world(tmp_path, jobs_cgroup="")
    record = world.dump(JOB)
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.cgroup == DAEMON_CGROUP
    assert set(JOB_TREE) <= set(world.cgroups.members(DAEMON_CGROUP))
    # a user's restore still goes into the user's cgroup
    record = world.dump(JOB)
    assert world.restore(USER, checkpoint_id=record.id).cgroup == USER_CGROUP


def test_without_cgroup_v2_criu_places_the_tree_as_it_always_did(tmp_path: Path) -> None:
    world = make_world(tmp_path, place_cgroups=False)
    record = world.dump(JOB)
    outcome = world.restore(USER, checkpoint_id=record.id)
    assert outcome.cgroup == ""
    (job,) = world.criu.restore_jobs
    assert job.restore_cgroups is True
    assert world.cgroups.moves == []


def test_a_process_not_born_in_the_cgroup_is_moved_there_at_post_restore(world: World) -> None:
    world.cgroups.add("/elsewhere")
    world.cgroups.born_in = "/elsewhere"  # as if something moved the new processes at once
    record = world.dump(JOB)
    seen = _seen_at_post_restore(world)
    world.restore(USER, checkpoint_id=record.id)
    assert seen == {p: (USER_CGROUP, PidState.STOPPED) for p in JOB_TREE}
    assert world.cgroups.moves[-1] == (JOB_TREE, USER_CGROUP)


def test_a_callers_cgroup_that_takes_no_processes_fails_the_restore_and_leaves_nothing(
    world: World,
) -> None:
    log = world.tmp / "job" / "train.log"
    log.parent.mkdir()
    log.write_bytes(b"step 1\n")
    world.files.open_for_writing(JOB, log)
    record = world.dump(JOB)
    log.write_bytes(b"step 1\nstep 2\n")
    world.cgroups.busy.add(USER_CGROUP)  # controllers enabled for its children meanwhile
    dumped = len(world.criu.hook_calls)

    with pytest.raises(CgroupUnavailable) as info:
        world.restore(USER, checkpoint_id=record.id)
    assert str(info.value).startswith(f"restore undone: cgroup {USER_CGROUP} takes no "
                                      "processes")
    assert info.value.checkpoint_id == record.id
    _nothing_left(world)
    assert log.read_bytes() == b"step 1\nstep 2\n", "the file put back is as it was found"
    assert world.criu.hook_calls[dumped:] == [], "CRIU began nothing"
    assert world.service.events.recent(1)[0].kind is EventKind.RESTORE_FAILED


def test_a_failed_move_at_post_restore_makes_criu_undo_the_restore(world: World) -> None:
    world.cgroups.add("/elsewhere")
    world.cgroups.born_in = "/elsewhere"
    record = world.dump(JOB)

    def cgroup_goes_bad(pid: int) -> None:  # after CRIU was placed, before post-restore
        del pid
        world.cgroups.fail_move = CgroupUnavailable(f"cgroup {USER_CGROUP} was removed")

    world.hooks.on["setup_namespaces"] = cgroup_goes_bad
    dumped = len(world.criu.hook_calls)
    with pytest.raises(CgroupUnavailable, match=f"restore undone: cgroup {USER_CGROUP} was"):
        world.restore(USER, checkpoint_id=record.id)
    _nothing_left(world)
    assert [n for n, _ in world.criu.hook_calls[dumped:]] == ["pre_restore", "setup_namespaces",
                                                     "post_restore"], "it never ran"


@pytest.mark.parametrize("why", ["gone", "outside"])
def test_a_caller_whose_cgroup_cannot_be_told_is_refused_before_anything(
    world: World, why: str
) -> None:
    record = world.dump(JOB)
    caller = USER
    if why == "gone":
        caller = Caller(uid=USER.uid, pid=4242)
    else:
        world.cgroups.outside.add(USER.pid or 0)
    with pytest.raises(CgroupUnavailable) as info:
        world.restore(caller, checkpoint_id=record.id)
    text = {"gone": "the caller (pid 4242) is gone", "outside": "outside the daemon's cgroup"}
    assert text[why] in str(info.value)
    assert world.criu.restore_jobs == []
    _nothing_left(world)


def test_helpers() -> None:
    assert within("/a", "/a") and within("/a/b", "/a") and within("/", "/")
    assert not within("/ab", "/a") and not within("/x", "/") and not within("/a", "/a/b")
    assert leaf_name("train", "r1a2b3c4") == "train-r1a2b3c4"
    assert leaf_name("a/b c\n", "r1") == "a_b_c_-r1"


def test_fake_cgroups_processes_inherit_and_sweeps_spare_the_populated() -> None:
    fake = FakeCgroups(default="/d")
    fake.spawn(1, "/x")
    fake.fork(2, 1)
    assert fake.cgroup_of(2) == "/x"
    fake.move([3], "/p/leaf", create=True)
    fake.add("/p/empty")
    assert fake.remove_empty("/p") == ["/p/empty"]
    assert fake.cgroup_of(3) == "/p/leaf"
