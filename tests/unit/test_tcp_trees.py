"""Trees with TCP connections, over the fakes: dumped with CRIU's tcp-established, held by
CRIU until the commit (a failure has CRIU resume them, connections unlocked), refused before
anything is frozen when a peer is outside the tree (unless --tcp-close or a group)."""

from __future__ import annotations

import pytest

from ckptd.domain import DumpRequest
from ckptd.domain.model import ROOT
from ckptd.errors import StoreError, TargetRefused

from .world import JOB, JOB_TREE, World

LOOP = ("127.0.0.1:41000", "127.0.0.1:29500")


def _connect_inside(world: World) -> None:
    world.processes.processes[1001].tcp = (LOOP,)
    world.processes.processes[1002].tcp = ((LOOP[1], LOOP[0]),)


def _dump(world: World, **kw: bool) -> None:
    world.service.dump(ROOT, DumpRequest(JOB, **kw), lambda _p: None)


def test_connections_inside_the_tree_are_dumped_and_restored_established(world: World) -> None:
    _connect_inside(world)
    record = world.dump(JOB)
    assert record.tcp_connections == 2 and not record.tcp_close
    assert world.criu.dump_jobs[0].tcp_established
    for pid in JOB_TREE:
        world.processes.remove(pid)
    world.restore(checkpoint_id=record.id)
    job = world.criu.restore_jobs[0]
    assert job.tcp_established and not job.tcp_close


def test_a_tree_without_connections_is_dumped_without_tcp_established(world: World) -> None:
    world.dump(JOB)
    assert not world.criu.dump_jobs[0].tcp_established


def test_a_peer_outside_the_tree_is_refused_before_anything_is_frozen(world: World) -> None:
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    message = info.value.message
    assert "pid 1001" in message and "10.0.0.9:29500" in message and "\n" not in message
    assert "--tcp-close" in (info.value.hint or "")
    assert world.criu.dump_jobs == []
    assert world.states(*JOB_TREE) == ["running"] * 3


def test_tcp_close_dumps_them_and_restores_them_closed(world: World) -> None:
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    _dump(world, tcp_close=True)
    (record,) = world.store.list()
    assert record.tcp_connections == 1 and record.tcp_close
    for pid in JOB_TREE:
        world.processes.remove(pid)
    world.restore(checkpoint_id=record.id)
    assert world.criu.restore_jobs[0].tcp_close


def test_a_group_member_may_talk_to_other_members(world: World) -> None:
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    _dump(world, tcp_peers_dumped=True)
    (record,) = world.store.list()
    assert record.tcp_connections == 1 and not record.tcp_close


def test_a_failed_commit_has_criu_resume_a_tree_with_connections(world: World) -> None:
    """Once CRIU is done, a stopped tree's sockets stay in repair mode and its network locked:
    no signal could resume it. So CRIU holds it until the commit, and resumes it itself."""
    _connect_inside(world)
    world.store.fail_commit = StoreError("cannot commit: disk full")
    with pytest.raises(StoreError):
        world.dump(JOB)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert "criu.failed" in world.events
    assert not any(e.startswith("criu.finished") for e in world.events)
    for pid in JOB_TREE:
        assert world.processes.signals_to(pid) == []


def test_criu_finishes_after_the_commit_for_a_tree_with_connections(world: World) -> None:
    _connect_inside(world)
    record = world.dump(JOB)
    events = world.events
    assert events.index(f"store.commit {record.id}") < events.index(f"criu.finished {JOB}")
