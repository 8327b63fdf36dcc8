"""``LazyWatch`` (``core.lazyrestore``) over the fakes: the end of a lazy restore, told from the
adapter's thread, acts only once the recipe has ended; ``done`` releases what the restore held
and says so; ``failed`` kills the tree (children forked since included) before it returns;
after a rolled-back recipe both do nothing."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.core.config import CoreConfig
from ckptd.core.events import EventBus
from ckptd.core.held import HeldTree
from ckptd.core.lazyrestore import LazyWatch
from ckptd.core.rollback import Undoer
from ckptd.core.undo import KillTree, UndoLog
from ckptd.domain import EventKind, PidState
from ckptd.errors import CorruptCheckpoint
from ckptd.testing import FakeClock, FakeProcessTable, MemoryJournal, MemoryStore

ROOT, CHILD, GRANDCHILD = 4000, 4001, 4002
HELPER = 4500
CHECKPOINT = "ck-20250101T000000-abcdef"
OP = "op-lazy"


class Rig:
    """A lazy restore as the recipe leaves it on success: the tree held and running, its
    journal entry open with a KillTree, the store's checkout in an ExitStack."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock()
        self.processes = FakeProcessTable(kill_mode="free")
        self.processes.add_tree(ROOT, CHILD, uid=1000)
        self.processes.add_process(HELPER, 1, comm="criu", start_time=4242)
        self.journal = MemoryJournal()
        self.bus = EventBus(self.clock)
        config = CoreConfig(node="n", daemon_pid=100, work_dir=tmp_path / "work",
                            output_dir=tmp_path / "out")
        self.undoer = Undoer(processes=self.processes, store=MemoryStore(tmp_path / "store"),
                             clock=self.clock, config=config)
        self.held = HeldTree(self.processes)
        self.held.hold_facts(self.processes.tree(ROOT))
        self.undo_log = UndoLog(self.journal, OP, "restore", CHECKPOINT)
        self.undo_log.record("criu-restore", KillTree(((ROOT, 1), (CHILD, 2))))
        self.released: list[str] = []
        self.resources = contextlib.ExitStack()
        self.resources.callback(self.released.append, "checkout")
        self.watch = LazyWatch(checkpoint_id=CHECKPOINT, uid=1000, processes=self.processes,
                               undoer=self.undoer, events=self.bus)

    def adopt(self) -> None:
        self.watch.adopt(self.resources, self.held, ROOT, self.undo_log)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.bus.recent()]

    def open_entries(self) -> list[str]:
        return [op for op, _ in self.journal.pending()]


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_started_records_the_page_daemon_with_its_start_time(rig: Rig) -> None:
    assert rig.watch.helper == []
    rig.watch.started(HELPER)
    assert rig.watch.helper == [HELPER, 4242]


def test_done_waits_for_the_recipe_then_releases_everything_and_says_so(rig: Rig) -> None:
    told = _in_thread(lambda: rig.watch.done(1234, 2.5))
    told.join(0.3)
    assert told.is_alive(), "done() acted before the recipe had ended"
    assert rig.kinds() == [] and rig.released == [] and rig.open_entries() == [OP]
    assert rig.watch.outcome == ""

    rig.adopt()
    told.join(10)
    assert not told.is_alive()
    (event,) = rig.bus.recent()
    assert event.kind is EventKind.RESTORE_LAZY_DONE
    assert (event.pid, event.checkpoint_id, event.uid) == (ROOT, CHECKPOINT, 1000)
    assert event.fields == {"pages": 1234, "seconds": 2.5, "tree_ended": False}
    assert "all 1234 page(s) in" in event.message
    assert rig.watch.outcome == "done"
    assert rig.open_entries() == []  # the journal entry ended: nothing for a restart to undo
    assert ("end", OP) in rig.journal.history
    assert rig.released == ["checkout"]
    assert rig.held.pids == [] and all(h.closed for h in rig.processes.handles)
    assert rig.processes.signals == []  # the tree runs on
    assert [rig.processes.state(p) for p in (ROOT, CHILD)] == [PidState.RUNNING] * 2


def test_done_after_the_tree_exited_says_the_tree_ended_not_that_every_page_came_in(
    rig: Rig,
) -> None:
    """CRIU's page daemon also ends when the last task it serves exits (the job was killed,
    or finished without touching the rest): that is no "all pages in"."""
    rig.adopt()
    for pid in (CHILD, ROOT):
        rig.processes.remove(pid)
    rig.watch.done(12, 0.05)
    (event,) = rig.bus.recent()
    assert event.kind is EventKind.RESTORE_LAZY_DONE
    assert event.fields == {"pages": 12, "seconds": 0.05, "tree_ended": True}
    assert "ended with its tree" in event.message and "all 12" not in event.message
    assert rig.open_entries() == [] and rig.released == ["checkout"]
    assert rig.processes.signals == []


def test_failed_kills_the_tree_with_what_it_forked_since_then_says_so(rig: Rig) -> None:
    rig.adopt()
    rig.processes.add_process(GRANDCHILD, CHILD, uid=1000)  # forked while pages came in
    error = CorruptCheckpoint(f"checkpoint {CHECKPOINT}: pack p1 frame 3 is damaged",
                              checkpoint_id=CHECKPOINT)
    told = _in_thread(lambda: rig.watch.failed(error))
    told.join(10)
    assert not told.is_alive()
    assert sorted(rig.processes.signals) == [(p, signal.SIGKILL) for p in
                                             (ROOT, CHILD, GRANDCHILD)]
    assert [rig.processes.state(p) for p in (ROOT, CHILD, GRANDCHILD)] == [PidState.FREE] * 3
    assert rig.processes.state(HELPER) is PidState.RUNNING  # the adapter lets it go itself
    (event,) = rig.bus.recent()
    assert event.kind is EventKind.RESTORE_LAZY_FAILED
    assert (event.pid, event.checkpoint_id, event.uid) == (ROOT, CHECKPOINT, 1000)
    assert event.fields == {"error": "CorruptCheckpoint"}
    assert CHECKPOINT in event.message and f"pid {ROOT}" in event.message
    assert "3 process(es)" in event.message and "frame 3 is damaged" in event.message
    assert rig.watch.outcome == str(error)
    assert rig.open_entries() == [] and rig.released == ["checkout"]
    assert all(h.closed for h in rig.processes.handles)


def test_failed_before_the_recipe_ended_waits_for_it(rig: Rig) -> None:
    error = CorruptCheckpoint("damaged", checkpoint_id=CHECKPOINT)
    told = _in_thread(lambda: rig.watch.failed(error))
    told.join(0.3)
    assert told.is_alive() and rig.processes.signals == []
    rig.adopt()
    told.join(10)
    assert not told.is_alive()
    assert rig.kinds() == [EventKind.RESTORE_LAZY_FAILED]
    assert {p for p, _ in rig.processes.signals} == {ROOT, CHILD}


@pytest.mark.parametrize("end", ["done", "failed"])
def test_after_a_rolled_back_recipe_nothing_is_done(rig: Rig, end: str) -> None:
    """The recipe's own rollback killed the tree and ended the entry: the watch's end is
    told (the adapter always tells one) and does nothing at all."""
    def tell() -> None:
        if end == "done":
            rig.watch.done(10, 1.0)
        else:
            rig.watch.failed(CorruptCheckpoint("damaged", checkpoint_id=CHECKPOINT))

    told = _in_thread(tell)
    rig.watch.abandon()
    told.join(10)
    assert not told.is_alive()
    assert rig.kinds() == [] and rig.processes.signals == []
    assert rig.watch.outcome == ""
    assert rig.open_entries() == [OP]  # the recipe's to end, not the watch's
    assert rig.released == [] and not any(h.closed for h in rig.processes.handles)


def test_without_an_event_bus_the_end_is_still_acted_on(rig: Rig) -> None:
    watch = LazyWatch(checkpoint_id=CHECKPOINT, uid=1000, processes=rig.processes,
                      undoer=rig.undoer, events=None)
    watch.adopt(rig.resources, rig.held, ROOT, rig.undo_log)
    watch.failed(CorruptCheckpoint("damaged", checkpoint_id=CHECKPOINT))
    assert {p for p, _ in rig.processes.signals} == {ROOT, CHILD}
    assert rig.open_entries() == [] and rig.released == ["checkout"]


def test_a_recipe_that_held_nothing_still_has_its_entry_ended_and_checkout_released(
    rig: Rig,
) -> None:
    rig.held.close()
    rig.watch.adopt(rig.resources, None, ROOT, rig.undo_log)
    rig.watch.done(0, 0.0)
    assert rig.released == ["checkout"]
    assert rig.open_entries() == []
