"""A daemon killed right after every step N of dump, restore and migrate, then restarted.

The daemon "dies" with ``Died``: raised right after step N's ``do``, it is a BaseException no
recipe code catches, and once it is raised no undo runs and CRIU is not told anything (a dead
process does nothing more); the journal is left as it was. A new service over the same fakes
(a restarted daemon) then runs ``recover``. Outcomes (docs/adr/0002): a killing dump whose
checkpoint was committed has its tree killed, else the tree runs as before with nothing
listed; nothing is left staged or journaled; an interrupted restore's tree is killed (a group
member only while its group never let it run), its checkpoint untouched; a migration
interrupted after its dump has the tree restored here, unless the target may run it: then its
target is asked after the restart, and the tree restored here only if it says it never
restored it; a migration target killed during its restore says "not restored" after its
restart (and never restores it afterwards).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from signal import SIGKILL
from typing import Any

import pytest

from ckptd.core.events import EventBus
from ckptd.core.migrate import MigrateRecipe
from ckptd.core.receive import Receiver
from ckptd.core.settle import Settler
from ckptd.core.undo import InDoubt, Received, received_op_id
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    EventKind,
    MigrateRequest,
    PeerProbe,
    ReceivedState,
    RemoteRestore,
    RestoreRequest,
)
from ckptd.domain.model import ROOT
from ckptd.errors import PreconditionFailed
from ckptd.testing import MemoryPageExchange

from .crashes import Death, Died, dying, step_names
from .world import JOB, JOB_TREE, World, guarded_world, make_world


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


def _restarted(world: World) -> list[str]:
    done = world.new_service().recover()
    assert list(world.journal.pending()) == []
    assert world.store.staged() == []
    return done


DUMP_STEPS, RESTORE_STEPS = step_names()


# ---- dump ---------------------------------------------------------------------------------


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
@pytest.mark.parametrize("step", DUMP_STEPS)
def test_a_dump_killed_after_any_step(world: World, step: str, leave_running: bool) -> None:
    original = world.dump_recipe.steps
    world.dump_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        world.dump(JOB, leave_running=leave_running)
    world.dump_recipe.steps = original
    committed = DUMP_STEPS.index(step) >= DUMP_STEPS.index("commit")

    _restarted(world)

    assert len(world.store.list()) == (1 if committed else 0)
    if committed and not leave_running:
        assert world.states(*JOB_TREE) == ["free"] * 3
    else:
        assert world.states(*JOB_TREE) == ["running"] * 3
    assert _restarted(world) == []  # recovery is done once


# ---- dump, with its guard (docs/adr/0016) ---------------------------------------------------


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
@pytest.mark.parametrize("step", DUMP_STEPS)
def test_a_guarded_dump_killed_after_any_step(
    tmp_path: Path, step: str, leave_running: bool,
) -> None:
    """The guard the recipe notifies (journal, criu-dump, commit, release) acts at once on
    the daemon's death; the restart then finds the same outcome and nothing left to do."""
    world, guard = guarded_world(tmp_path)
    original = world.dump_recipe.steps
    world.dump_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        world.dump(JOB, leave_running=leave_running)
    world.dump_recipe.steps = original
    committed = DUMP_STEPS.index(step) >= DUMP_STEPS.index("commit")
    guard.watch.daemon_gone()
    after_guard = world.states(*JOB_TREE)
    by_guard = len(world.processes.signals)

    _restarted(world)

    assert len(world.store.list()) == (1 if committed else 0)
    expected = ["free" if committed and not leave_running else "running"] * 3
    assert after_guard == expected  # at once, not at the restart
    assert world.states(*JOB_TREE) == expected
    assert world.processes.signals[by_guard:] == []  # the restart had nothing left to do
    assert _restarted(world) == []


@pytest.mark.parametrize("leave_running", [False, True], ids=["killing", "leave-running"])
@pytest.mark.parametrize("with_guard", [True, False], ids=["guard", "no-guard"])
def test_a_dump_killed_inside_its_commit_once_durable(
    tmp_path: Path, with_guard: bool, leave_running: bool,
) -> None:
    """The daemon dies after the store committed, before the guard heard so: the guard
    (told only that the commit was under way) resumes a killing dump's tree and journals
    GuardResumed; the restart deletes the checkpoint instead of killing the tree. Without a
    guard, the restart kills the committed tree (ADR 0002)."""
    world, guard = guarded_world(tmp_path)
    commit, original = world.store.commit, world.dump_recipe.steps
    death = Death("")  # no step ends: the process dies inside the commit step
    world.dump_recipe.steps = dying(original, death)

    def commit_then_die(record: CheckpointRecord) -> CheckpointRecord:
        commit(record)  # CRIU has finished (no TCP): nothing to tell it
        death.dead = True
        raise Died("commit")

    world.store.commit = commit_then_die  # type: ignore[method-assign]
    with pytest.raises(Died):
        world.dump(JOB, leave_running=leave_running)
    world.store.commit, world.dump_recipe.steps = commit, original  # type: ignore[method-assign]
    assert len(world.store.list()) == 1
    if with_guard:
        guard.watch.daemon_gone()
        assert world.states(*JOB_TREE) == ["running"] * 3

    done = _restarted(world)

    resumed_by_guard = with_guard and not leave_running
    assert len(world.store.list()) == (0 if resumed_by_guard else 1)
    killed = not leave_running and not with_guard
    assert world.states(*JOB_TREE) == ["free" if killed else "running"] * 3
    if resumed_by_guard:
        assert "guard resumed" in done[0] and "rolled back dump" in done[0]
        assert all(sig != SIGKILL for _, sig in world.processes.signals)
    assert _restarted(world) == []


# ---- restore --------------------------------------------------------------------------------


@pytest.mark.parametrize("held", [False, True], ids=["plain", "group-member"])
@pytest.mark.parametrize("step", RESTORE_STEPS)
def test_a_restore_killed_after_any_step(world: World, step: str, held: bool) -> None:
    record = world.dump(JOB)
    assert world.states(*JOB_TREE) == ["free"] * 3
    original = world.restore_recipe.steps
    world.restore_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id),
                              gate=(lambda _pid: None) if held else None)
    world.restore_recipe.steps = original
    journaled = RESTORE_STEPS.index(step) >= RESTORE_STEPS.index("stdio")  # RemoveOutput on
    let_run = held and RESTORE_STEPS.index(step) >= RESTORE_STEPS.index("gate")

    done = _restarted(world)

    assert [r.id for r in world.store.list()] == [record.id]  # untouched
    if let_run:  # its group let it run: a member is never killed then
        assert world.states(*JOB_TREE) == ["running"] * 3
    else:
        assert world.states(*JOB_TREE) == ["free"] * 3
    assert bool(done) == (journaled and not let_run)  # a member let run: its entry ended
    if not let_run:  # the checkpoint restores again
        assert world.restore(checkpoint_id=record.id).pid == JOB


@pytest.mark.parametrize("written", [False, True], ids=["empty", "written"])
def test_a_restore_killed_after_stdio_leaves_no_empty_output_file(
    world: World, written: bool,
) -> None:
    """The output file ckptd chose is removed at the restart while empty (RemoveOutput); one
    the tree (or anyone) wrote to is kept."""
    record = world.dump(JOB)
    original = world.restore_recipe.steps
    world.restore_recipe.steps = dying(original, Death("stdio"))
    with pytest.raises(Died):
        world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id))
    world.restore_recipe.steps = original
    [(_, facts)] = world.journal.pending()
    [undo] = facts["undo"]
    assert undo["kind"] == "remove-output"
    output = Path(undo["path"])
    assert output.parent == world.config.output_dir
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(b"x" if written else b"")

    done = _restarted(world)

    assert output.exists() == written
    assert ("removed (empty)" in done[0]) == (not written)


# ---- migrate --------------------------------------------------------------------------------


SHARED = "one-store"


class _Target:
    """A target daemon sharing this node's store: it records what it was asked."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.aborted = 0
        self.asked: list[str] = []
        self.restored_there = True
        """What it answers when asked about a checkpoint it finished."""

    # PeerConnector / PeerLink
    address = "b:7443"

    def connect(self, address: str) -> _Target:
        return self

    def probe(self, record: CheckpointRecord) -> PeerProbe:
        return PeerProbe(node="node-b", store_id=SHARED, report=CompatReport())

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> _Target:
        self.record = record
        return self

    def received(self, checkpoint_id: str) -> ReceivedState:
        self.asked.append(checkpoint_id)
        restored = checkpoint_id in self.finished and self.restored_there
        return ReceivedState(checkpoint_id, "node-b", restored=restored,
                             pid=4321 if restored else 0)

    def close(self) -> None:
        pass

    # PeerSession
    page_seed = 0

    def offer_pages(self, *_: Any) -> list[int]:
        return []

    def offer_file(self, *_: Any) -> None:
        pass

    def send(self, frames: Iterator[Any]) -> int:
        return 0

    def finish(self, output_path: str) -> RemoteRestore:
        self.finished.append(self.record.id)
        return RemoteRestore(self.record.id, 4321, "", "node-b")

    def abort(self) -> None:
        self.aborted += 1


class _Pages:
    store_id = SHARED


MIGRATE_STEPS = ["connect", "probe", "dump", "open", "send", "finish"]


def _migrate(world: World, target: _Target) -> MigrateRecipe:
    service = world.service
    return MigrateRecipe(
        preview=world.dump_recipe.preview, dump=service.dump, restore_here=service.restore,
        pages=_Pages(), connector=target, clock=world.clock,  # type: ignore[arg-type]
        journal=world.journal,
    )


@pytest.mark.parametrize("step", [s for s in MIGRATE_STEPS if s != "finish"])
def test_a_migration_killed_after_any_step(world: World, step: str) -> None:
    target = _Target()
    recipe = _migrate(world, target)
    assert [s.name for s in recipe.steps] == MIGRATE_STEPS
    recipe.steps = dying(recipe.steps, Death(step))
    with pytest.raises(Died):
        recipe.run(ROOT, MigrateRequest(pid=JOB, to="b:7443"), lambda _p: None)
    dumped = MIGRATE_STEPS.index(step) >= MIGRATE_STEPS.index("dump")

    done = _restarted(world)

    assert len(world.store.list()) == (1 if dumped else 0)
    # not touched, or back here from its checkpoint (killed in finish: the test below)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert not target.finished
    assert any("restored on this node" in line for line in done) == dumped


def test_a_migration_rolled_back_in_process_leaves_nothing_journaled(world: World) -> None:
    target = _Target()
    recipe = _migrate(world, target)

    def refuse(_: str) -> RemoteRestore:
        from ckptd.errors import PeerError
        raise PeerError("the target refused", address="b:7443")

    target.finish = refuse  # type: ignore[method-assign,assignment]
    with pytest.raises(Exception, match="refused"):
        recipe.run(ROOT, MigrateRequest(pid=JOB, to="b:7443"), lambda _p: None)
    assert list(world.journal.pending()) == []
    assert world.states(*JOB_TREE) == ["running"] * 3  # restored here in-process


@pytest.mark.parametrize("there", [True, False], ids=["restored-there", "not-there"])
def test_a_migration_killed_in_finish_asks_its_target_after_the_restart(
    world: World, there: bool,
) -> None:
    """Killed once the target began restoring: the restart leaves the InDoubt entry for
    settlement (nothing restored yet); the target asked says whether it restored it: if it
    did, nothing runs here; if not, the tree is restored here. Either way the entry ends and
    ``migrate.settled`` names the side."""
    target = _Target()
    target.restored_there = there
    recipe = _migrate(world, target)
    recipe.steps = dying(recipe.steps, Death("finish"))
    with pytest.raises(Died):
        recipe.run(ROOT, MigrateRequest(pid=JOB, to="b:7443"), lambda _p: None)
    [record] = world.store.list()

    service = world.new_service()
    done = service.recover()
    [(op_id, doubt)] = service.unsettled
    assert isinstance(doubt, InDoubt) and (doubt.checkpoint_id, doubt.to) == (record.id, "b:7443")
    assert [op for op, _ in world.journal.pending()] == [op_id], "kept until settled"
    assert world.states(*JOB_TREE) == ["free"] * 3 and target.asked == []
    assert "in doubt" in done[0]

    events = EventBus(world.clock)
    settler = Settler(connector=target, restore_here=service.restore,
                      clock=world.clock, journal=world.journal, events=events)
    settled = settler.settle(op_id, doubt)

    assert target.asked == [record.id]
    assert list(world.journal.pending()) == []
    assert world.states(*JOB_TREE) == (["free"] * 3 if there else ["running"] * 3)
    assert settled.restored_on == ("target" if there else "source")
    [event] = [e for e in events.recent() if e.kind is EventKind.MIGRATE_SETTLED]
    assert event.fields["restored_on"] == settled.restored_on
    assert [r.id for r in world.store.list()] == [record.id]  # kept either way
    assert world.new_service().recover() == []  # settled once


def _target_of(world: World, service: object) -> Receiver:
    """A migration target over ``world``'s store (shared with its source: ``finish`` only
    restores), restoring through ``service`` with the journal of ``world``."""
    return Receiver(
        store=world.store, pages=MemoryPageExchange(), check=lambda _r: CompatReport(),
        restore=lambda request, staged, received: service.restore(  # type: ignore[attr-defined]
            ROOT, request, staged=staged, received=received),
        clock=world.clock, node="node-b", journal=world.journal,
    )


@pytest.mark.parametrize("step", RESTORE_STEPS)
def test_a_migration_target_killed_after_any_step_of_its_restore(
    world: World, step: str,
) -> None:
    """The target dies while restoring a migrated checkpoint: at its restart the half-done
    restore is undone, and asked about it, it says "not restored" and fences it (a later
    ``finish`` is refused): it has no record of a restore that did not end with the tree
    running."""
    record = world.dump(JOB)
    receiver = _target_of(world, world.service)
    session, _seed = receiver.open(record, ignore_warnings=False)
    original = world.restore_recipe.steps
    world.restore_recipe.steps = dying(original, Death(step))
    with pytest.raises(Died):
        receiver.finish(session, "")
    world.restore_recipe.steps = original

    service = world.new_service()
    service.recover()
    assert world.states(*JOB_TREE) == ["free"] * 3
    restarted = _target_of(world, service)
    state = restarted.received(record.id)

    assert (state.restored, state.restoring) == (False, False)
    [(op_id, facts)] = world.journal.pending()
    assert op_id == received_op_id(record.id)
    assert Received.from_facts(facts) == Received(record.id, restored=False,
                                                  time=world.clock.time())
    again, _seed = restarted.open(record, ignore_warnings=False)
    with pytest.raises(PreconditionFailed, match="settled as not restored"):
        restarted.finish(again, "")
    assert world.states(*JOB_TREE) == ["free"] * 3, "fenced: never restored after the answer"
    assert _target_of(world, world.new_service()).received(record.id) == state


def test_a_migration_target_whose_restore_ran_says_so_after_a_restart(world: World) -> None:
    """The restore's journal entry ended into the ``Received`` record (one write): a target
    restarted after it answers "restored" with the pid, from that record alone."""
    record = world.dump(JOB)
    receiver = _target_of(world, world.service)
    session, _seed = receiver.open(record, ignore_warnings=False)
    done = receiver.finish(session, "")
    assert world.states(*JOB_TREE) == ["running"] * 3

    service = world.new_service()
    assert service.recover() == []
    state = _target_of(world, service).received(record.id)

    assert (state.restored, state.pid, state.node) == (True, done.pid, "node-b")
    assert [op for op, _ in world.journal.pending()] == [received_op_id(record.id)]
    world.clock.advance(31 * 86400)  # a month later: forgotten at a start
    assert world.new_service().recover() == []
    assert list(world.journal.pending()) == []
