"""Contract of ``PolicyRepo``: the JSON file and ``MemoryPolicyRepo`` behave the same.

Implementations are listed in ``REPOS``: each makes a repo and another one over the same
saved state (as after a daemon restart)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.adapters.storage.policyfile import JsonPolicyRepo
from ckptd.core.ports import PolicyRepo
from ckptd.domain import Policy
from ckptd.testing import MemoryPolicyRepo

Reopen = Callable[[], PolicyRepo]


def _json(tmp: Path) -> Reopen:
    return lambda: JsonPolicyRepo(tmp / "policies.json")


def _memory(tmp: Path) -> Reopen:
    saved: list[Policy] = []
    return lambda: MemoryPolicyRepo(saved)


REPOS: dict[str, Callable[[Path], Reopen]] = {"json-file": _json, "memory": _memory}

TRAIN = Policy("train", pid=1000, every_s=600.0, keep=3, on_term=True, uid=1000,
               last_fired=1.7e9, last_checkpoint_id="ck-20260101T000000-aaaaaa", started=42)
EVAL = Policy("eval", every_s=60.0)


@pytest.fixture(params=sorted(REPOS))
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Reopen:
    return REPOS[request.param](tmp_path)


def test_nothing_saved_loads_empty(reopen: Reopen) -> None:
    assert reopen().load() == []


def test_save_then_load_gives_every_field_back_in_order(reopen: Reopen) -> None:
    repo = reopen()
    repo.save([TRAIN, EVAL])
    assert repo.load() == [TRAIN, EVAL]


def test_save_replaces_the_whole_set(reopen: Reopen) -> None:
    repo = reopen()
    repo.save([TRAIN, EVAL])
    repo.save([EVAL])
    assert repo.load() == [EVAL]
    repo.save([])
    assert repo.load() == []


def test_policies_survive_a_restart(reopen: Reopen) -> None:
    reopen().save([TRAIN])
    assert reopen().load() == [TRAIN]


def test_what_load_returned_is_not_the_saved_set(reopen: Reopen) -> None:
    repo = reopen()
    repo.save([TRAIN])
    loaded = repo.load()
    loaded.append(EVAL)
    assert repo.load() == [TRAIN]
