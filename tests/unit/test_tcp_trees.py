"""Trees with TCP connections, over the fakes: dumped with CRIU's tcp-established, held by
CRIU until the commit (a failure has CRIU resume them, connections unlocked); a peer outside
the tree restored established where the node has the connection's local address, closed (the
outcome naming it) where it does not, refused before anything is frozen only with
``tcp_outside_peers = "refuse"`` (unless --tcp-close or a group); a connection in CRIU's
images that the dump did not lock fails it before the commit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.core.compat import check_restore
from ckptd.core.targets import check_tcp
from ckptd.domain import DumpRequest, TcpConnection
from ckptd.domain.model import ROOT
from ckptd.errors import CriuFailed, StoreError, TargetRefused

from .world import JOB, JOB_TREE, World, make_world

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


def test_a_peer_outside_the_tree_is_refused_before_anything_is_frozen_where_asked(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path, tcp_outside_peers="refuse")
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    message = info.value.message
    assert "pid 1001" in message and "10.0.0.9:29500" in message and "\n" not in message
    assert "--tcp-close" in (info.value.hint or "")
    assert "tcp_outside_peers" in message
    assert world.criu.dump_jobs == []
    assert world.states(*JOB_TREE) == ["running"] * 3


def test_a_peer_outside_the_tree_is_dumped_and_restored_established_where_the_address_is(
    world: World,
) -> None:
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    record = world.dump(JOB)
    assert record.tcp_connections == 1 and not record.tcp_close
    assert world.criu.dump_jobs[0].tcp_established
    for pid in JOB_TREE:
        world.processes.remove(pid)
    outcome = world.restore(checkpoint_id=record.id)
    job = world.criu.restore_jobs[0]
    assert job.tcp_established and not job.tcp_close
    assert outcome.tcp_closed == ""


def test_where_a_connection_s_local_address_is_missing_the_restore_brings_them_back_closed(
    world: World,
) -> None:
    world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)
    record = world.dump(JOB)
    assert [(c.local, c.remote) for c in record.tcp] == [("10.0.0.2:41000", "10.0.0.9:29500")]
    world.node.missing_addresses.add("10.0.0.2")
    report = check_restore(record, world.node)
    (note,) = report.notes
    assert "closed, not established" in note and "10.0.0.2:41000 -> 10.0.0.9:29500" in note
    for pid in JOB_TREE:
        world.processes.remove(pid)
    outcome = world.restore(checkpoint_id=record.id)
    job = world.criu.restore_jobs[0]
    assert job.tcp_established and job.tcp_close
    assert "restored closed" in outcome.tcp_closed and "10.0.0.2:41000" in outcome.tcp_closed


def test_a_connection_its_peer_reset_is_never_refused(tmp_path: Path) -> None:
    conn = TcpConnection(1001, "job", "10.0.0.2:41000", "10.0.0.9:29500", "CLOSE", 7)
    check_tcp([conn], 1000, tcp_close=False, peers_dumped=False)
    with pytest.raises(TargetRefused):
        check_tcp([replace(conn, state="CLOSE_WAIT")], 1000, tcp_close=False,
                  peers_dumped=False)


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


def test_a_connection_in_the_images_the_dump_did_not_lock_fails_it_before_the_commit(
    world: World,
) -> None:
    """One made between the inspection and the freeze: CRIU's images hold it, the dump ran
    without tcp_established, so no restore could bring it back: nothing is listed."""

    def connect(_pid: int) -> None:
        world.processes.processes[1001].tcp = (("10.0.0.2:41000", "10.0.0.9:29500"),)

    world.hooks.on["pre_dump"] = connect
    with pytest.raises(CriuFailed) as info:
        world.dump(JOB)
    assert "10.0.0.2:41000 -> 10.0.0.9:29500" in info.value.message
    assert "nothing was committed" in info.value.message and "\n" not in info.value.message
    assert world.store.list() == []
    assert world.states(*JOB_TREE) == ["running"] * 3
