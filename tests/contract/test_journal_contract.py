"""Contract of ``Journal``: every implementation behaves the same (see core/ports/)."""

from __future__ import annotations

from .harness import JournalHarness

FACTS = {"op": "dump", "checkpoint_id": "ck-1", "pids": [10, 11], "stopped_before": [11]}


def test_empty_journal_has_nothing_pending(journal_harness: JournalHarness) -> None:
    assert list(journal_harness.journal.pending()) == []


def test_begin_end_pending_round_trip(journal_harness: JournalHarness) -> None:
    journal = journal_harness.journal
    journal.begin("op-a", FACTS)
    journal.begin("op-b", {"op": "other"})
    assert dict(journal.pending()) == {"op-a": FACTS, "op-b": {"op": "other"}}
    journal.end("op-a")
    assert list(journal.pending()) == [("op-b", {"op": "other"})]
    journal.end("op-b")
    assert list(journal.pending()) == []


def test_end_is_idempotent(journal_harness: JournalHarness) -> None:
    journal = journal_harness.journal
    journal.begin("op-a", FACTS)
    journal.end("op-a")
    journal.end("op-a")
    journal.end("never-begun")
    assert list(journal.pending()) == []


def test_begin_again_replaces_the_facts(journal_harness: JournalHarness) -> None:
    journal = journal_harness.journal
    journal.begin("op-a", FACTS)
    journal.begin("op-a", {"op": "dump", "pids": []})
    assert list(journal.pending()) == [("op-a", {"op": "dump", "pids": []})]


def test_facts_are_a_snapshot(journal_harness: JournalHarness) -> None:
    facts = {"op": "dump", "pids": [1]}
    journal_harness.journal.begin("op-a", facts)
    facts["pids"].append(2)  # type: ignore[attr-defined]
    assert list(journal_harness.journal.pending()) == [("op-a", {"op": "dump", "pids": [1]})]


def test_end_while_iterating_pending(journal_harness: JournalHarness) -> None:
    journal = journal_harness.journal
    for op in ("op-a", "op-b", "op-c"):
        journal.begin(op, {"op": op})
    seen = []
    for op_id, _facts in list(journal.pending()):
        journal.end(op_id)
        seen.append(op_id)
    assert seen == ["op-a", "op-b", "op-c"]
    assert list(journal.pending()) == []


def test_entries_survive_a_new_instance(journal_harness: JournalHarness) -> None:
    journal_harness.journal.begin("op-a", FACTS)
    again = journal_harness.reopen()
    assert list(again.pending()) == [("op-a", FACTS)]
    again.end("op-a")
    assert list(journal_harness.reopen().pending()) == []
