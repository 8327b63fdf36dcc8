"""CheckpointService: reads with caller checks, delete, and recovery after a crash."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest

from ckptd.core.dump import DumpContext
from ckptd.core.recipe import record_undo
from ckptd.domain import DumpRequest, PidState, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import Busy, CheckpointNotFound, PermissionDenied

from .world import JOB, JOB_TREE, OTHER, OTHER_JOB, USER, World, make_world

SIGKILL, SIGCONT = int(signal.SIGKILL), int(signal.SIGCONT)


def _three(world: World) -> tuple[Any, Any, Any]:
    a = world.dump(JOB, USER, name="train", leave_running=True)
    b = world.dump(OTHER_JOB, ROOT, name="train", leave_running=True)
    c = world.dump(JOB, USER, name="eval", leave_running=True)
    return a, b, c


def test_list_filters_by_uid_for_non_root_callers(world: World) -> None:
    a, b, c = _three(world)
    ids = lambda records: [r.id for r in records]  # noqa: E731
    assert ids(world.service.list(ROOT)) == [a.id, b.id, c.id]
    assert ids(world.service.list(USER)) == [a.id, c.id]
    assert ids(world.service.list(OTHER)) == [b.id]
    assert ids(world.service.list(ROOT, pid=JOB)) == [a.id, c.id]
    assert ids(world.service.list(ROOT, name="train")) == [a.id, b.id]
    assert ids(world.service.list(USER, name="train")) == [a.id]
    assert ids(world.service.list(OTHER, pid=JOB)) == []


def test_get_checks_the_owner(world: World) -> None:
    a, b, _ = _three(world)
    assert world.service.get(USER, a.id) == world.store.get(a.id)
    assert world.service.get(ROOT, a.id).id == a.id
    with pytest.raises(PermissionDenied) as info:
        world.service.get(USER, b.id)
    assert info.value.checkpoint_id == b.id
    assert f"checkpoint {b.id} belongs to uid 2000, the caller is uid 1000" in str(info.value)
    with pytest.raises(CheckpointNotFound):
        world.service.get(ROOT, "ck-20200101T000000-000000")


def test_delete_checks_the_owner(world: World) -> None:
    a, b, c = _three(world)
    with pytest.raises(PermissionDenied):
        world.service.delete(USER, b.id)
    assert [r.id for r in world.store.list()] == [a.id, b.id, c.id]
    world.service.delete(USER, a.id)
    world.service.delete(ROOT, b.id)
    assert [r.id for r in world.store.list()] == [c.id]
    assert not world.store.images_dir(a.id).exists()
    with pytest.raises(CheckpointNotFound):
        world.service.delete(USER, a.id)


def test_check_returns_the_probe(world: World) -> None:
    assert world.service.check().node == "test-node"


# ---- recovery ---------------------------------------------------------------------------------


def _crash_after(world: World, step: str, request: DumpRequest) -> DumpContext:
    """Run the dump recipe's steps up to and including ``step``, then "crash" (stop)."""
    ctx = world.dump_recipe.new_context(ROOT, request)
    for s in world.dump_recipe.steps:
        record_undo(s, ctx, ctx.undo_log)  # as run_steps does: the undo durable first
        s.do(ctx)
        if s.name == step:
            return ctx
    raise AssertionError(f"no step {step}")


def test_recover_with_nothing_pending(world: World) -> None:
    assert world.new_service().recover() == []
    assert world.processes.signals == []


def test_recover_rolls_back_an_uncommitted_dump(world: World) -> None:
    world.processes.processes[1001].state = PidState.STOPPED
    ctx = _crash_after(world, "criu-dump", DumpRequest(JOB))
    assert world.states(*JOB_TREE) == ["stopped"] * 3
    assert world.store.staged() == [ctx.checkpoint_id]

    done = world.new_service().recover()

    assert len(done) == 1
    assert f"rolled back dump {ctx.checkpoint_id}" in done[0]
    assert world.store.staged() == []
    assert not world.store.staging_dir(ctx.checkpoint_id).exists()
    assert world.store.list() == []
    assert list(world.journal.pending()) == []
    assert world.states(*JOB_TREE) == ["running", "stopped", "running"]
    assert world.processes.signals_to(1000) == [SIGCONT]
    assert world.processes.signals_to(1001) == []
    assert world.processes.signals_to(1002) == [SIGCONT]
    assert all(signo != SIGKILL for _pid, signo in world.processes.signals)


def test_recover_after_a_crash_before_criu(world: World) -> None:
    ctx = _crash_after(world, "stage", DumpRequest(JOB))
    done = world.new_service().recover()
    assert f"rolled back dump {ctx.checkpoint_id}" in done[0]
    assert world.store.staged() == []
    assert world.processes.signals == []  # nothing was stopped
    assert world.states(*JOB_TREE) == ["running"] * 3


def test_recover_kills_the_tree_of_a_committed_dump(world: World) -> None:
    ctx = _crash_after(world, "commit", DumpRequest(JOB))
    assert ctx.record is not None
    done = world.new_service().recover()
    assert done == [f"finished dump {ctx.checkpoint_id}: it was committed"]
    assert [pid for pid, signo in world.processes.signals if signo == SIGKILL] == list(JOB_TREE)
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert [r.id for r in world.store.list()] == [ctx.checkpoint_id]
    assert list(world.journal.pending()) == []


def test_recover_leaves_a_committed_leave_running_dump_alone(world: World) -> None:
    ctx = _crash_after(world, "commit", DumpRequest(JOB, leave_running=True))
    done = world.new_service().recover()
    assert done == [f"finished dump {ctx.checkpoint_id}: it was committed"]
    assert world.processes.signals == []
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert list(world.journal.pending()) == []


def test_recover_ends_unknown_operations(world: World) -> None:
    world.journal.begin("r1234", {"op": "restore"})
    world.journal.begin("junk", {})
    assert world.new_service().recover() == []
    assert list(world.journal.pending()) == []
    assert world.processes.signals == []
    assert world.store.calls == []


def test_recover_does_not_kill_a_process_that_reused_a_pid(world: World) -> None:
    ctx = _crash_after(world, "release", DumpRequest(JOB))
    # crash between the kills and journal.end: re-journal as the recipe had it
    world.journal.begin(
        ctx.checkpoint_id,
        {"op": "dump", "checkpoint_id": ctx.checkpoint_id, "pids": list(JOB_TREE),
         "stopped_before": [], "leave_running": False},
    )
    world.processes.add_process(1001, 1, comm="unrelated")  # pid reused meanwhile
    world.processes.signals.clear()
    world.new_service().recover()
    assert world.processes.signals_to(1001) == []
    assert world.processes.state(1001) is PidState.RUNNING


# ---- concurrency ------------------------------------------------------------------------------


def _block_in(world: World, hook: str, pid_match: int | None = None) -> tuple[Any, Any]:
    entered, release = threading.Event(), threading.Event()

    def block(pid: int) -> None:
        if pid_match is None or pid == pid_match:
            entered.set()
            assert release.wait(10)

    world.hooks.on[hook] = block
    return entered, release


def test_delete_during_a_restore_of_that_checkpoint_keeps_its_images(world: World) -> None:
    record = world.dump(JOB)
    entered, release = _block_in(world, "pre_restore")
    errors: list[BaseException] = []

    def restore() -> None:
        try:
            world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=restore)
    thread.start()
    try:
        assert entered.wait(10)
        images = world.criu.restore_jobs[0].images_dir
        with contextlib.suppress(Busy):
            world.service.delete(ROOT, record.id)
        assert images.is_dir(), "images removed under a running restore"
    finally:
        release.set()
        thread.join(10)
    assert errors == []


def test_pruning_keeps_the_work_dir_of_an_operation_in_flight(tmp_path: Any) -> None:
    world = make_world(tmp_path, keep_work_dirs=1)
    entered, release = _block_in(world, "post_dump", JOB)
    errors: list[BaseException] = []

    def slow_dump() -> None:
        try:
            world.service.dump(ROOT, DumpRequest(JOB, leave_running=True))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow_dump)
    thread.start()
    try:
        assert entered.wait(10)
        work_dir = world.criu.dump_jobs[0].work_dir
        started = time.time() - 60  # the slow dump started a minute ago
        os.utime(work_dir, (started, started))
        world.clock.advance(1)
        world.service.dump(ROOT, DumpRequest(OTHER_JOB, leave_running=True))
        assert work_dir.is_dir(), "work dir of the dump in flight was pruned"
    finally:
        release.set()
        thread.join(10)
    assert errors == []


def test_wait_idle_waits_for_a_running_dump(world: World) -> None:
    started, release = threading.Event(), threading.Event()

    def block(_pid: int) -> None:
        started.set()
        release.wait(5)

    world.hooks.on["post_dump"] = block
    worker = threading.Thread(target=lambda: world.dump(JOB, leave_running=True))
    worker.start()
    assert started.wait(5)
    assert len(world.service.wait_idle(0.05)) == 1  # still running after the timeout
    threading.Timer(0.1, release.set).start()
    t0 = time.monotonic()
    assert world.service.wait_idle(5) == []
    assert time.monotonic() - t0 < 4
    worker.join(5)
    assert len(world.store.list()) == 1


def test_a_closing_service_refuses_new_dumps_but_still_restores(world: World) -> None:
    from ckptd.errors import Cancelled

    record = world.dump(JOB)
    world.service.close()
    with pytest.raises(Cancelled, match="stopping"):
        world.dump(OTHER_JOB)
    assert world.restore(checkpoint_id=record.id).pid == JOB


def test_recover_forgets_an_entry_it_cannot_read(world: World) -> None:
    world.journal.begin("r1", {"version": 2, "op": "restore", "undo": [{"kind": "reboot"}]})
    world.journal.begin("r2", {"version": 7, "op": "restore", "undo": []})
    assert world.new_service().recover() == []
    assert list(world.journal.pending()) == []
    assert world.processes.signals == []


def test_gc_passes_no_compact_to_the_store(world: World) -> None:
    """``ckptctl gc --no-compact`` reaches the store as ``compact=False``; plain gc compacts."""
    world.service.gc(ROOT)
    world.service.gc(ROOT, compact=False)
    assert world.store.gc_compact == [True, False]


def test_what_retention_deletes_is_collected_soon_at_most_once_a_minute(world: World) -> None:
    """Issue 34, 8: with ``--every 10s --keep N`` the store grew between hourly collections.
    A retention deletion makes the next ``collect_after_retention`` collect, once a minute at
    most; nothing deleted, nothing collected."""
    def keep_one() -> None:
        world.clock.advance(10.0)
        world.service.dump(USER, DumpRequest(JOB, leave_running=True, name="train", keep=1))

    collect = world.service.collect_after_retention
    keep_one()
    assert collect() is None and world.store.gc_compact == []  # retention deleted nothing
    keep_one()  # deletes the first
    report = collect()
    assert report is not None and world.store.gc_compact == [True]  # as the periodic GC does
    assert collect() is None  # nothing deleted since
    keep_one()  # 10 s after that collection: rate-limited
    assert collect() is None and world.store.gc_compact == [True]
    world.clock.advance(49.0)
    assert collect() is None
    world.clock.advance(1.0)  # a minute after the last collection began
    assert collect() is not None and world.store.gc_compact == [True, True]
    world.service.gc(ROOT)  # a periodic (or ckptctl) collection counts too
    keep_one()
    world.clock.advance(49.0)
    assert collect() is None
    world.clock.advance(1.0)
    assert collect() is not None and len(world.store.gc_compact) == 4
