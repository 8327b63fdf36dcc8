"""Typed undo records: their journal encoding, and the adapter from old daemons' entries."""

from __future__ import annotations

import json

import pytest

from ckptd.core.undo import (
    VERSION,
    AbortStaging,
    BadEntry,
    GuardResumed,
    InDoubt,
    KillTree,
    RestoreHere,
    ResumeCuda,
    ResumeTree,
    Undo,
    UndoLog,
    decode_entry,
    legacy_undos,
    with_guard_resumed,
)
from ckptd.testing import MemoryJournal

CK = "ck-20260101T000000-aaaaaa"
EVERY: list[Undo] = [
    AbortStaging(CK),
    ResumeCuda(((1000, 77),), unless_committed=CK),
    ResumeTree(((1000, 77), (1001, 78)), (1001,), unless_committed=CK),
    KillTree(((1000, 77),), only_stopped=True, if_committed=CK),
    RestoreHere(CK, 1000, "b:7443"),
    InDoubt(CK, "b:7443"),
    GuardResumed(CK),
]


def test_every_record_round_trips_through_a_journal_as_json() -> None:
    journal = MemoryJournal()
    log = UndoLog(journal, "op-1", "dump", CK)
    for index, undo in enumerate(EVERY):
        log.record(f"step-{index}", undo)
    ((op_id, facts),) = journal.pending()
    assert op_id == "op-1" and facts["version"] == VERSION
    json.dumps(facts)  # plain JSON
    entry = decode_entry(facts)
    assert (entry.op, entry.checkpoint_id, entry.undos) == ("dump", CK, tuple(EVERY))
    log.end()
    assert list(journal.pending()) == []


def test_recording_a_step_again_replaces_its_record_in_place() -> None:
    journal = MemoryJournal()
    log = UndoLog(journal, "op-1", "dump", CK)
    log.record("stage", AbortStaging(CK))
    log.record("criu-dump", ResumeTree(((1, 1),)))
    log.record("criu-dump", ResumeTree(((1, 1), (2, 2))))
    assert decode_entry(dict(journal.pending())["op-1"]).undos == (
        AbortStaging(CK), ResumeTree(((1, 1), (2, 2))))


def test_the_guard_appends_its_record_once_to_a_typed_dump_entry_only() -> None:
    log = UndoLog(None, CK, "dump", CK)
    log.record("stage", AbortStaging(CK))
    facts = with_guard_resumed(with_guard_resumed(log.facts()))
    assert decode_entry(json.loads(json.dumps(facts))).undos == (AbortStaging(CK),
                                                                 GuardResumed(CK))
    for other in ({"op": "dump", "pids": [1]},  # an old daemon's: left to the next start
                  UndoLog(None, "op", "restore", CK).facts(),
                  {"version": VERSION, "op": "dump", "undo": "x"}):
        with pytest.raises(BadEntry):
            with_guard_resumed(other)


def test_a_log_without_journal_or_never_begun_writes_nothing() -> None:
    UndoLog(None, "op", "dump").record("stage", AbortStaging(CK))
    journal = MemoryJournal()
    UndoLog(journal, "op", "restore").end()
    assert journal.history == []


@pytest.mark.parametrize("facts", [
    {"version": 99, "op": "dump", "undo": []},
    {"version": VERSION, "op": "dump", "undo": [{"kind": "format-disk"}]},
    {"version": VERSION, "op": "dump", "undo": [{"kind": "kill-tree", "members": "x"}]},
    {"version": VERSION, "op": "dump", "undo": {"kind": "kill-tree"}},
])
def test_an_entry_that_is_not_undo_records_is_refused(facts: dict[str, object]) -> None:
    with pytest.raises(BadEntry):
        decode_entry(facts)  # type: ignore[arg-type]


def test_an_old_daemons_killing_dump_becomes_its_records() -> None:
    facts = {"op": "dump", "checkpoint_id": CK, "pids": [1000, 1001],
             "members": [[1000, 77], [1001, 78]], "stopped_before": [1001],
             "leave_running": False, "cuda_pids": [1000]}
    entry = decode_entry(facts)
    assert entry.version == 1 and entry.op == "dump"
    assert entry.undos == (
        AbortStaging(CK),
        ResumeCuda(((1000, 77),), unless_committed=CK),
        ResumeTree(((1000, 77), (1001, 78)), (1001,), unless_committed=CK),
        KillTree(((1000, 77), (1001, 78)), if_committed=CK),
    )


def test_an_old_daemons_entry_with_pids_only_has_unknown_start_times() -> None:
    facts = {"op": "dump", "checkpoint_id": CK, "pids": [5, 6], "stopped_before": [],
             "leave_running": True}
    assert legacy_undos(facts) == (AbortStaging(CK), ResumeTree(((5, 0), (6, 0)), (),
                                                                unless_committed=CK))


def test_an_old_daemons_held_restore_and_unknown_ops() -> None:
    held = {"op": "held-restore", "checkpoint_id": CK, "pids": [7], "members": [[7, 9]]}
    assert decode_entry(held).undos == (KillTree(((7, 9),), only_stopped=True),)
    assert decode_entry({"op": "restore"}).undos == ()
    assert decode_entry({}).undos == ()
