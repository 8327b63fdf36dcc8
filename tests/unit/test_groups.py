"""GroupMembers over the fake node: a member is held dumped-but-uncommitted until the
decision; commit lists it, abort and timeout resume it and keep nothing; restores are held
stopped, then run or are killed."""

from __future__ import annotations

import time

import pytest

from ckptd.core.groups import GroupMembers
from ckptd.domain import Caller, DumpRequest, GroupMember, GroupRecord, PidState
from ckptd.domain.model import ROOT
from ckptd.errors import Cancelled, CheckpointNotFound, PermissionDenied, ProcessNotFound

from .world import JOB, JOB_TREE, OTHER_JOB, USER, World


def members(world: World) -> GroupMembers:
    return GroupMembers(world.service.dump, world.store, world.service.restore)


def test_prepared_members_are_held_unlisted_then_committed(world: World) -> None:
    g = members(world)
    ck_a = g.prepare(ROOT, "g1", DumpRequest(JOB, name="rank0"))
    ck_b = g.prepare(ROOT, "g1", DumpRequest(OTHER_JOB, name="rank1"))
    assert world.store.list() == [], "nothing is listed before the commit"
    assert set(world.states(*JOB_TREE)) == {"stopped"}, "held: stopped"
    records = g.commit(ROOT, "g1")
    assert sorted(r.id for r in records) == sorted([ck_a, ck_b])
    assert sorted(r.id for r in world.store.list()) == sorted([ck_a, ck_b])
    assert all(world.processes.state(p) is PidState.FREE for p in JOB_TREE), "then killed"
    g.record(GroupRecord("g1", "job", 1.0, (GroupMember("n", "unix:x", ck_a, JOB),)))
    assert [gr.id for gr in g.list_groups()] == ["g1"]


def test_abort_resumes_every_member_and_keeps_nothing(world: World) -> None:
    g = members(world)
    g.prepare(ROOT, "g2", DumpRequest(JOB))
    assert g.abort(ROOT, "g2") == 1
    assert set(world.states(*JOB_TREE)) == {"running"}
    assert world.store.list() == []
    with pytest.raises(CheckpointNotFound):
        g.commit(ROOT, "g2")


def test_a_member_whose_dump_fails_raises_at_prepare(world: World) -> None:
    g = members(world)
    with pytest.raises(ProcessNotFound):
        g.prepare(ROOT, "g3", DumpRequest(4242))
    assert g.abort(ROOT, "g3") == 0


def test_a_held_member_resumes_by_itself_when_no_decision_comes(world: World) -> None:
    g = members(world)
    g.prepare(ROOT, "g4", DumpRequest(JOB), timeout_s=1.0)  # a real wait (threading.Event)
    time.sleep(1.5)
    with pytest.raises(Cancelled, match="no commit within 1s"):
        g.commit(ROOT, "g4")
    assert set(world.states(*JOB_TREE)) == {"running"}
    assert world.store.list() == []


def test_only_the_members_owner_decides(world: World) -> None:
    g = members(world)
    g.prepare(USER, "g5", DumpRequest(JOB))
    with pytest.raises(PermissionDenied):
        g.commit(Caller(uid=2000), "g5")
    g.abort(USER, "g5")


def test_a_group_restore_is_held_stopped_then_runs_or_is_killed(world: World) -> None:
    record = world.dump(JOB)
    g = members(world)
    pid = g.prepare_restore(ROOT, "r1", record.id)
    assert pid == JOB and set(world.states(*JOB_TREE)) == {"stopped"}
    outcomes = g.commit(ROOT, "r1")
    assert [o.pid for o in outcomes] == [JOB]
    assert set(world.states(*JOB_TREE)) == {"running"}

    for p in JOB_TREE:
        world.processes.remove(p)
    g.prepare_restore(ROOT, "r2", record.id)
    g.abort(ROOT, "r2")
    assert all(world.processes.state(p) is PidState.FREE for p in JOB_TREE), "killed"


def test_a_stopping_daemon_undoes_every_held_member(world: World) -> None:
    g = members(world)
    g.prepare(ROOT, "g6", DumpRequest(JOB))
    assert g.abort_all() == 1
    assert set(world.states(*JOB_TREE)) == {"running"}
    assert world.store.list() == []


def test_users_see_and_record_only_groups_of_their_own_checkpoints(world: World) -> None:
    g = members(world)
    mine = world.dump(JOB, USER)
    theirs = world.dump(OTHER_JOB)
    own = GroupRecord("g7", "", 1.0, (GroupMember("n", "unix:x", mine.id, JOB),))
    mixed = GroupRecord("g8", "", 1.0, (GroupMember("n", "unix:x", mine.id, JOB),
                                        GroupMember("n", "unix:x", theirs.id, OTHER_JOB)))
    elsewhere = GroupRecord("g9", "", 1.0, (GroupMember("m", "unix:y", "ck-none", 1),))
    assert g.owned_by(own, USER) and not g.owned_by(mixed, USER)
    assert not g.owned_by(elsewhere, USER) and g.owned_by(mixed, ROOT)


def test_a_daemon_killed_while_holding_a_restored_member_kills_it_at_restart(
    world: World,
) -> None:
    """The held tree is stopped and its group never let it run: the next start undoes it."""
    record = world.dump(JOB)
    g = members(world)
    g.prepare_restore(ROOT, "r9", record.id)
    assert set(world.states(*JOB_TREE)) == {"stopped"}
    assert [f.get("op") for _op, f in world.journal.pending()] == ["held-restore"]
    done = world.new_service().recover()  # a restarted daemon, same journal
    assert any("undid held group restore" in line for line in done)
    assert all(world.processes.state(p) is PidState.FREE for p in JOB_TREE)
    assert list(world.journal.pending()) == []
    g.abort(ROOT, "r9")  # release the old daemon's waiting thread
