"""A daemon killed right after every step N of dump, restore and migrate, then restarted.

The daemon "dies" with ``Died``: raised right after step N's ``do``, it is a BaseException no
recipe code catches, and once it is raised no undo runs and CRIU is not told anything (a dead
process does nothing more); the journal is left as it was. A new service over the same fakes
(a restarted daemon) then runs ``recover``. Outcomes (docs/adr/0002): a killing dump whose
checkpoint was committed has its tree killed, else the tree runs as before with nothing
listed; nothing is left staged or journaled; an interrupted restore's tree is killed (a group
member only while its group never let it run), its checkpoint untouched; a migration
interrupted after its dump has the tree restored here, unless the target may run it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from signal import SIGKILL
from typing import Any

import pytest

from ckptd.core.migrate import MigrateRecipe
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    MigrateRequest,
    PeerProbe,
    RemoteRestore,
    RestoreRequest,
)
from ckptd.domain.model import ROOT

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

    # PeerConnector / PeerLink
    address = "b:7443"

    def connect(self, address: str) -> _Target:
        return self

    def probe(self, record: CheckpointRecord) -> PeerProbe:
        return PeerProbe(node="node-b", store_id=SHARED, report=CompatReport())

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> _Target:
        self.record = record
        return self

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


@pytest.mark.parametrize("step", MIGRATE_STEPS)
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
    if step == "finish":  # the target may run it: never restored twice
        assert target.finished and world.states(*JOB_TREE) == ["free"] * 3
        assert any("check there" in line for line in done)
    else:  # not touched, or back here from its checkpoint
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
