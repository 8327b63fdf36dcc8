"""Issue 21 (9): a checkpoint or job name is its owner's. One user's name never reaches
another's checkpoints (restore by name, retention) nor blocks another's job of that name, and
another user's checkpoint id is never shown in an error. Over the fakes."""

from __future__ import annotations

import pytest

from ckptd.domain import DumpRequest
from ckptd.domain.model import ROOT
from ckptd.errors import CheckpointNotFound, InvalidTarget

from .world import JOB, OTHER, OTHER_JOB, USER, World


def test_restore_by_name_sees_only_the_callers_own_checkpoints(world: World) -> None:
    mine = world.dump(JOB, name="train")  # uid 1000's; its tree is gone, restorable
    theirs = world.dump(OTHER_JOB, name="train", leave_running=True)  # uid 2000's, newer
    assert theirs.created > mine.created
    outcome = world.restore(USER, name="train")
    assert outcome.checkpoint_id == mine.id


def test_another_users_name_is_not_found_and_its_id_never_shown(world: World) -> None:
    theirs = world.dump(OTHER_JOB, name="theirs", leave_running=True)
    with pytest.raises(CheckpointNotFound, match="no checkpoint of name 'theirs'") as info:
        world.restore(USER, name="theirs")
    assert theirs.id not in str(info.value) and info.value.checkpoint_id is None
    with pytest.raises(CheckpointNotFound) as info:
        world.restore(USER, pid=OTHER_JOB)
    assert theirs.id not in str(info.value)


def test_root_is_asked_for_the_id_when_owners_share_a_name(world: World) -> None:
    mine = world.dump(JOB, name="train")
    theirs = world.dump(OTHER_JOB, name="train", leave_running=True)
    with pytest.raises(InvalidTarget, match=r"checkpoints named 'train' belong to uids "
                       r"1000, 2000.*give the checkpoint id"):
        world.restore(ROOT, name="train")
    assert world.restore(ROOT, checkpoint_id=mine.id).checkpoint_id == mine.id
    assert theirs.id


def test_one_users_retention_never_deletes_anothers_checkpoints(world: World) -> None:
    mine = world.dump(JOB, name="train", leave_running=True)
    world.clock.advance(1.0)
    world.service.dump(OTHER, DumpRequest(OTHER_JOB, leave_running=True, name="train",
                                          keep=1))
    world.clock.advance(1.0)
    kept = world.service.dump(OTHER, DumpRequest(OTHER_JOB, leave_running=True, name="train",
                                                 keep=1))
    ids = {r.id for r in world.store.list()}
    assert mine.id in ids, "uid 2000's --keep 1 deleted uid 1000's checkpoint"
    assert {r.id for r in world.store.list() if r.uid == OTHER.uid} == {kept.id}

