"""A lazy restore through the service, over the fakes (``FakeCriu`` honours
``CriuRestoreJob.lazy``): the restore returns with the tree running while its pages are still
served; until the last page the journal entry stays open (a KillTree of the tree, then of
CRIU's page daemon) and the store's checkout is held; then both end, ``restore.lazy_done``.
A page that cannot be served kills the tree (``restore.lazy_failed``). Refused where it
cannot be lazy."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.domain import EventKind, RestoreOutcome, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import CorruptCheckpoint, CriuFailed, PreconditionFailed

from .world import JOB, JOB_TREE, World, make_world


def _lazy(world: World, checkpoint_id: str) -> RestoreOutcome:
    world.clock.advance(1.0)
    return world.service.restore(ROOT, RestoreRequest(checkpoint_id=checkpoint_id, lazy=True))


def _dumped(world: World) -> str:
    world.criu.streams_restore = True
    record = world.dump(JOB)
    assert world.states(*JOB_TREE) == ["free"] * 3
    return record.id


def _kinds(world: World) -> list[EventKind]:
    return [e.kind for e in world.service.events.recent()]


def test_a_lazy_restore_returns_running_and_ends_its_entry_when_all_pages_are_in(
    world: World,
) -> None:
    checkpoint_id = _dumped(world)
    mark = len(world.processes.signals)
    world.criu.pages_served.clear()  # pages still coming after the restore returns
    outcome = _lazy(world, checkpoint_id)
    assert outcome.lazy and outcome.pid == JOB
    assert world.states(*JOB_TREE) == ["running"] * 3
    (job,) = world.criu.restore_jobs
    assert job.lazy is not None and job.images is not None
    helper = next(int(e.split()[1]) for e in world.events if e.startswith("criu.lazy_started"))
    assert world.processes.state(helper).value == "running"

    (entry,) = [facts for _, facts in world.journal.pending()]
    kill = next(u for u in entry["undo"] if u["step"] == "criu-restore")
    assert [m[0] for m in kill["members"]] == [*JOB_TREE, helper]  # the page daemon last
    assert EventKind.RESTORE_LAZY_DONE not in _kinds(world)

    world.criu.pages_served.set()
    world.criu.join_lazy()
    assert list(world.journal.pending()) == []
    assert world.store.open_checkouts == 0
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.processes.signals[mark:] == []
    (done,) = [e for e in world.service.events.recent()
               if e.kind is EventKind.RESTORE_LAZY_DONE]
    assert (done.pid, done.checkpoint_id) == (JOB, checkpoint_id)
    assert done.fields["pages"] == 3


def test_the_store_s_checkout_is_held_until_the_last_page_is_served(world: World) -> None:
    checkpoint_id = _dumped(world)
    world.criu.pages_served.clear()
    try:
        _lazy(world, checkpoint_id)
        assert world.store.open_checkouts == 1
    finally:
        world.criu.pages_served.set()
        world.criu.join_lazy()
    assert world.store.open_checkouts == 0


def test_a_daemon_killed_during_a_lazy_restore_recovers_naming_its_checkpoint(
    world: World,
) -> None:
    """Issue 33 (7): the journal entry of a restore names its checkpoint, so that the next
    start's line says which restore it undid (it said ``restore of : killed [...]``)."""
    checkpoint_id = _dumped(world)
    world.criu.pages_served.clear()  # the daemon dies while pages are still served
    try:
        _lazy(world, checkpoint_id)
        (entry,) = [facts for _, facts in world.journal.pending()]
        assert entry["checkpoint_id"] == checkpoint_id
        done = world.new_service().recover()
    finally:
        world.criu.pages_served.set()
        world.criu.join_lazy()
    (line,) = [d for d in done if "restore of" in d]
    assert f"undid interrupted restore of {checkpoint_id}: killed [" in line, line
    assert world.states(*JOB_TREE) == ["free"] * 3


def test_a_page_that_cannot_be_served_kills_the_tree(world: World) -> None:
    checkpoint_id = _dumped(world)
    mark = len(world.processes.signals)
    world.criu.fail_lazy = CorruptCheckpoint(
        f"checkpoint {checkpoint_id}: pack p1 frame 0 is damaged", checkpoint_id=checkpoint_id)
    outcome = _lazy(world, checkpoint_id)
    world.criu.join_lazy()
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert sorted(world.processes.signals[mark:]) == [(p, signal.SIGKILL)
                                                      for p in sorted(JOB_TREE)]
    (failed,) = [e for e in world.service.events.recent()
                 if e.kind is EventKind.RESTORE_LAZY_FAILED]
    assert (failed.pid, failed.checkpoint_id) == (outcome.pid, checkpoint_id)
    assert "frame 0 is damaged" in failed.message
    assert list(world.journal.pending()) == [] and world.store.open_checkouts == 0


def test_a_failed_lazy_restore_is_rolled_back_by_the_recipe_alone(world: World) -> None:
    checkpoint_id = _dumped(world)
    world.criu.fail_restore = CriuFailed("CRIU restore failed: Reached EOF unexpectedly")
    with pytest.raises(CriuFailed):
        _lazy(world, checkpoint_id)
    world.criu.join_lazy()  # the page daemon's end told: the watch does nothing
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert EventKind.RESTORE_LAZY_FAILED not in _kinds(world)
    assert list(world.journal.pending()) == [] and world.store.open_checkouts == 0


def test_a_criu_that_does_not_stream_cannot_restore_lazily(world: World) -> None:
    record = world.dump(JOB)
    with pytest.raises(PreconditionFailed, match=r"lazily: this CRIU cannot stream"):
        _lazy(world, record.id)
    assert world.criu.restore_jobs == []


def test_a_stopping_daemon_waits_for_a_lazy_restore_s_pages(world: World) -> None:
    """``wait_idle`` (the daemon's graceful stop) counts a lazy restore in flight until its
    last page is served: a stop does not leave the job waiting on pages for the next start
    to kill."""
    checkpoint_id = _dumped(world)
    world.criu.pages_served.clear()
    try:
        _lazy(world, checkpoint_id)
        running = world.service.wait_idle(0.05)
        assert len(running) == 1 and running[0].startswith("r"), running
    finally:
        world.criu.pages_served.set()
        world.criu.join_lazy()
    assert world.service.wait_idle(5.0) == []


def _refused_lazily(world: World, checkpoint_id: str, why: str,
                    request: RestoreRequest | None = None) -> None:
    world.clock.advance(1.0)
    request = request or RestoreRequest(checkpoint_id=checkpoint_id, lazy=True)
    with pytest.raises(PreconditionFailed, match=rf"cannot restore {checkpoint_id} lazily: {why}"
                       ) as raised:
        world.service.restore(ROOT, request)
    assert raised.value.hint == "restore it without --lazy"
    assert world.criu.restore_jobs == []
    assert [r.id for r in world.store.list()] == [checkpoint_id], "the checkpoint is kept"
    assert list(world.journal.pending()) == [] and world.store.open_checkouts == 0


def test_a_daemon_that_does_not_stream_restores_refuses_lazily(world: World) -> None:
    checkpoint_id = _dumped(world)
    world.restore_recipe._config = replace(world.config, stream_restore=False)
    _refused_lazily(world, checkpoint_id, r"this daemon does not stream restores")


def test_a_gpu_checkpoint_is_refused_lazily(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    world.gpu.add_cuda_process(JOB, 1 << 30)
    world.criu.streams_restore = True
    record = world.dump(JOB)
    assert record.gpu is not None
    _refused_lazily(world, record.id, r"it is a GPU checkpoint")
