"""The documented behaviour of the fakes in ckptd.testing (beyond the contract suites)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from ckptd.core.ports import CriuDumpJob, CriuHooks, CriuRestoreJob, InheritFd
from ckptd.core.store.restream import DirectoryImages
from ckptd.domain import PidState, StdioFact, StdioKind
from ckptd.errors import CkptdError, CorruptCheckpoint, CriuFailed, CriuUnavailable, StoreError
from ckptd.testing import (
    DUMP_HOOKS,
    RESTORE_HOOKS,
    FakeClock,
    FakeCriu,
    FakeProcessTable,
    FakeStdioProvider,
    MemoryJournal,
    MemoryStore,
)

# ---- FakeClock --------------------------------------------------------------------------------


def test_clock_sleep_advances_at_once_and_is_recorded() -> None:
    clock = FakeClock(start=100.0, monotonic_start=5.0)
    clock.sleep(0.5)
    clock.advance(2)
    assert (clock.time(), clock.monotonic()) == (102.5, 7.5)
    assert clock.sleeps == [0.5]


def test_clock_refuses_to_go_backwards() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError):
        clock.sleep(-1)
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_clock_sleep_listeners() -> None:
    clock = FakeClock()
    heard: list[float] = []
    remove = clock.on_sleep(heard.append)
    clock.sleep(1)
    remove()
    remove()
    clock.sleep(2)
    assert heard == [1]


# ---- FakeProcessTable -------------------------------------------------------------------------


def test_table_kill_modes() -> None:
    for mode, after in (("zombie", PidState.ZOMBIE), ("free", PidState.FREE)):
        table = FakeProcessTable(kill_mode=mode)  # type: ignore[arg-type]
        table.add_tree(10, 11)
        assert table.signal(10, signal.SIGKILL) is True
        assert table.state(10) is after
        assert table.status(11).ppid == 1  # re-parented to init


def test_table_stop_cont_and_zombies_ignore_signals() -> None:
    table = FakeProcessTable(kill_mode="zombie")
    table.add_process(10)
    table.signal(10, signal.SIGSTOP)
    assert table.state(10) is PidState.STOPPED
    table.signal(10, signal.SIGCONT)
    assert table.state(10) is PidState.RUNNING
    table.signal(10, signal.SIGKILL)
    assert table.signal(10, signal.SIGCONT) is True
    assert table.state(10) is PidState.ZOMBIE
    table.reap(10)
    assert table.state(10) is PidState.FREE
    assert table.signals_to(10) == [signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL, signal.SIGCONT]


def test_table_other_signals_are_only_recorded() -> None:
    table = FakeProcessTable()
    table.add_process(10)
    assert table.signal(10, signal.SIGTERM) is True
    assert table.state(10) is PidState.RUNNING
    assert table.signals == [(10, signal.SIGTERM)]


def test_table_reap_after_n_sleeps() -> None:
    clock = FakeClock()
    table = FakeProcessTable(kill_mode="zombie")
    table.add_process(10)
    table.signal(10, signal.SIGKILL)
    table.reap_after(clock, 10, sleeps=2)
    clock.sleep(0.1)
    assert table.state(10) is PidState.ZOMBIE
    clock.sleep(0.1)
    assert table.state(10) is PidState.FREE
    with pytest.raises(ValueError):
        table.reap(10)


def test_table_refuses_duplicate_pids_and_events_are_logged() -> None:
    events: list[str] = []
    table = FakeProcessTable(events=events)
    table.add_process(10)
    with pytest.raises(ValueError):
        table.add_process(10)
    table.signal(10, signal.SIGSTOP)
    assert table.signal(99, signal.SIGKILL) is False  # nothing there: nothing delivered
    assert events == ["signal 10 SIGSTOP"]


def test_table_stdio_is_reported_per_tree() -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11)
    facts = table.standard_stdio(11)
    assert table.stdio(table.tree(10)) == facts
    assert table.stdio(table.tree(11)) == facts


# ---- FakeCriu ---------------------------------------------------------------------------------


class RecordingHooks(CriuHooks):
    def __init__(self, table: FakeProcessTable) -> None:
        self.table = table
        self.seen: list[tuple[str, PidState]] = []

    def _note(self, name: str, pid: int) -> None:
        self.seen.append((name, self.table.state(10)))

    def pre_dump(self, pid: int) -> None:
        self._note("pre_dump", pid)

    def post_dump(self, pid: int) -> None:
        self._note("post_dump", pid)

    def post_restore(self, pid: int) -> None:
        self._note("post_restore", pid)

    def post_resume(self, pid: int) -> None:
        self._note("post_resume", pid)


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    return images, work


class Told:
    """``ports.LazyPages`` recording what it was told, and whether the page daemon was in
    the table at each call."""

    def __init__(self, table: FakeProcessTable) -> None:
        self.table = table
        self.calls: list[tuple[str, object, bool]] = []
        self.ended = threading.Event()

    def _daemon_there(self, pid: int) -> bool:
        return self.table.state(pid) is not PidState.FREE

    def started(self, helper_pid: int) -> None:
        self.helper = helper_pid
        self.calls.append(("started", helper_pid, self._daemon_there(helper_pid)))

    def failed(self, error: CkptdError) -> None:
        self.calls.append(("failed", error, self._daemon_there(self.helper)))
        self.ended.set()

    def done(self, pages: int, seconds: float) -> None:
        self.calls.append(("done", (pages, seconds), self._daemon_there(self.helper)))
        self.ended.set()


def _dumped_for_lazy(tmp_path: Path) -> tuple[FakeProcessTable, FakeCriu, list[str], Path]:
    table = FakeProcessTable()
    table.add_tree(10, 11, 12, uid=1000)
    events: list[str] = []
    criu = FakeCriu(table, events=events)
    (tmp_path / "dump").mkdir()
    images, work = _dirs(tmp_path / "dump")
    criu.dump(CriuDumpJob(10, images, work, leave_running=False), CriuHooks()).finish()
    return table, criu, events, images


def _lazy_job(tmp_path: Path, images: Path, told: Told) -> CriuRestoreJob:
    (tmp_path / "restore").mkdir(parents=True)
    staged, work = _dirs(tmp_path / "restore")
    return CriuRestoreJob(staged, work, images=DirectoryImages(images, "ck-lazy"), lazy=told)


def test_criu_lazy_restore_starts_a_page_daemon_and_tells_done_once_returned(
    tmp_path: Path,
) -> None:
    table, criu, events, images = _dumped_for_lazy(tmp_path)
    told = Told(table)
    assert criu.restore(_lazy_job(tmp_path, images, told), CriuHooks()) == 10
    criu.join_lazy()
    helper = told.helper
    assert helper not in (10, 11, 12)
    assert told.calls == [("started", helper, True), ("done", (3, 0.0), False)]
    assert table.status(helper).state is PidState.FREE  # it exited after the last page
    assert [table.state(p) for p in (10, 11, 12)] == [PidState.RUNNING] * 3
    started = next(e for e in events if e.startswith("criu.started "))
    assert events.index(f"criu.lazy_started {helper}") < events.index(started) \
        < events.index("criu.restored 10") < events.index("criu.lazy_done 3")
    told_again = Told(table)  # a new daemon each lazy restore
    for pid in (10, 11, 12):
        table.remove(pid)
    criu.restore(_lazy_job(tmp_path / "again", images, told_again), CriuHooks())
    criu.join_lazy()
    assert told_again.helper != helper


def test_criu_lazy_end_is_told_from_a_thread_that_may_wait(tmp_path: Path) -> None:
    """``LazyWatch`` waits in ``done`` until the recipe has ended, so the fake must not tell
    it from within ``restore``."""
    table, criu, _events, images = _dumped_for_lazy(tmp_path)
    release = threading.Event()

    class Waits(Told):
        def done(self, pages: int, seconds: float) -> None:
            assert release.wait(10)
            super().done(pages, seconds)

    told = Waits(table)
    assert criu.restore(_lazy_job(tmp_path, images, told), CriuHooks()) == 10
    with pytest.raises(TimeoutError):
        criu.join_lazy(0.2)
    release.set()
    criu.join_lazy()
    assert [c[0] for c in told.calls] == ["started", "done"]


def test_criu_fail_lazy_tells_failed_while_the_page_daemon_still_runs(tmp_path: Path) -> None:
    table, criu, events, images = _dumped_for_lazy(tmp_path)
    criu.fail_lazy = CorruptCheckpoint("checkpoint ck-lazy: frame 2 is damaged",
                                       checkpoint_id="ck-lazy")
    told = Told(table)
    assert criu.restore(_lazy_job(tmp_path, images, told), CriuHooks()) == 10
    criu.join_lazy()
    assert told.calls == [("started", told.helper, True), ("failed", criu.fail_lazy, True)]
    assert table.status(told.helper).state is PidState.FREE  # let go once failed returned
    assert "criu.lazy_failed" in events and not any("lazy_done" in e for e in events)


def test_criu_failed_lazy_restore_stops_the_daemon_then_tells_failed(tmp_path: Path) -> None:
    table, criu, _events, images = _dumped_for_lazy(tmp_path)
    criu.fail_restore = CriuFailed("CRIU restore failed: Reached EOF unexpectedly")
    told = Told(table)
    with pytest.raises(CriuFailed, match="EOF"):
        criu.restore(_lazy_job(tmp_path, images, told), CriuHooks())
    criu.join_lazy()
    assert [(name, there) for name, _, there in told.calls] == [("started", True),
                                                                ("failed", False)]
    error = told.calls[1][1]
    assert isinstance(error, CriuFailed) and "hung up" in error.message
    assert [table.state(p) for p in (10, 11, 12, told.helper)] == [PidState.FREE] * 4


def test_criu_lazy_restore_needs_images_on_the_node(tmp_path: Path) -> None:
    table, criu, events, _images = _dumped_for_lazy(tmp_path)
    (tmp_path / "restore").mkdir()
    staged, work = _dirs(tmp_path / "restore")
    told = Told(table)
    before = set(table.processes)
    with pytest.raises(CriuFailed, match="lazy restore reads its images from the store"):
        criu.restore(CriuRestoreJob(staged, work, lazy=told), CriuHooks())
    assert told.calls == [] and criu.lazy_ends == []
    assert set(table.processes) == before
    assert not any("lazy" in e for e in events)


def test_criu_lazy_daemon_refused_by_criu_started_fails_before_anything(tmp_path: Path) -> None:
    table, criu, _events, images = _dumped_for_lazy(tmp_path)

    class Refuses(CriuHooks):
        def criu_started(self, criu_pid: int) -> None:
            raise RuntimeError(f"cannot place {criu_pid}")

    told = Told(table)
    before = set(table.processes)
    with pytest.raises(CriuFailed, match="cannot place"):
        criu.restore(_lazy_job(tmp_path, images, told), Refuses())
    assert told.calls == [] and criu.lazy_ends == []
    assert set(table.processes) == before  # the daemon gone, no process of the tree made


def test_criu_dump_then_restore_round_trip(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11, 12, uid=1000)
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    hooks = RecordingHooks(table)
    held = criu.dump(CriuDumpJob(10, images, work, leave_running=False), hooks)
    assert held.pids == (10, 11, 12)
    assert [table.state(p) for p in (10, 11, 12)] == [PidState.STOPPED] * 3  # held frozen
    result = held.finish()
    assert result.pages_written == 3
    assert result.pids == (10, 11, 12)
    assert [n for n, _ in criu.hook_calls] == list(DUMP_HOOKS)
    assert all(pid == 10 for _, pid in criu.hook_calls)
    assert hooks.seen == [("pre_dump", PidState.RUNNING), ("post_dump", PidState.STOPPED)]
    assert [table.state(p) for p in (10, 11, 12)] == [PidState.FREE] * 3
    assert {p.name for p in images.iterdir()} == {
        "inventory.img", "pstree.img", "pages-10.img", "pages-11.img", "pages-12.img",
    }
    assert (work / "dump.log").is_file()

    assert criu.restore(CriuRestoreJob(images, work), hooks) == 10
    assert [n for n, _ in criu.hook_calls[4:]] == list(RESTORE_HOOKS)
    assert criu.hook_calls[4] == ("pre_restore", 0)
    assert hooks.seen[2:] == [("post_restore", PidState.STOPPED), ("post_resume", PidState.RUNNING)]
    assert [table.state(p) for p in (10, 11, 12)] == [PidState.RUNNING] * 3
    assert table.status(10).ppid == 1
    assert table.status(11).ppid == 10
    assert table.status(11).uid == 1000


@pytest.mark.parametrize(
    ("leave_running", "leave_stopped", "after"),
    [(True, False, PidState.RUNNING), (False, True, PidState.STOPPED),
     (False, False, PidState.FREE)],
)
def test_criu_dump_leaves_the_tree_as_asked(
    tmp_path: Path, leave_running: bool, leave_stopped: bool, after: PidState
) -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11)
    images, work = _dirs(tmp_path)
    job = CriuDumpJob(10, images, work, leave_running, leave_stopped)
    FakeCriu(table).dump(job, CriuHooks()).finish()
    assert [table.state(10), table.state(11)] == [after, after]
    assert table.signals == []


def test_criu_restore_brings_back_a_process_stopped_before_the_dump(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11)
    table.processes[11].state = PidState.STOPPED
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    criu.dump(CriuDumpJob(10, images, work, leave_running=False), CriuHooks()).finish()
    criu.restore(CriuRestoreJob(images, work), CriuHooks())
    assert [table.state(10), table.state(11)] == [PidState.RUNNING, PidState.STOPPED]


def test_criu_status_and_unavailability(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_process(10)
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table, version="4.2")
    assert criu.status().ok and criu.status().version == "4.2"
    criu.set_status(False, "broken")
    assert criu.status().message == "broken"
    with pytest.raises(CriuUnavailable):
        criu.dump(CriuDumpJob(10, images, work, leave_running=True), CriuHooks())
    with pytest.raises(CriuUnavailable):
        criu.restore(CriuRestoreJob(images, work), CriuHooks())
    assert criu.status_calls == 3  # dump and restore do not count


def test_criu_dump_failure_leaves_the_tree_running(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11)
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    criu.fail_dump = CriuFailed("nope")
    criu.fail_dump_after = "post_dump"
    with pytest.raises(CriuFailed, match="nope"):
        criu.dump(CriuDumpJob(10, images, work, leave_running=False), CriuHooks())
    assert [table.state(10), table.state(11)] == [PidState.RUNNING] * 2
    assert "Error" in (work / "dump.log").read_text()


def test_criu_dump_held_at_post_dump_then_aborted_runs_on(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_tree(10, 11)
    table.processes[11].state = PidState.STOPPED
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    held = criu.dump(CriuDumpJob(10, images, work, leave_running=False, leave_stopped=True),
                     CriuHooks())
    assert [table.state(10), table.state(11)] == [PidState.STOPPED] * 2
    held.abort()
    held.abort()  # idempotent
    assert [table.state(10), table.state(11)] == [PidState.RUNNING, PidState.STOPPED]
    with pytest.raises(CriuFailed, match="aborted"):
        held.finish()


def test_criu_dump_of_a_missing_pid_or_directory(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_process(10)
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    with pytest.raises(CriuFailed, match="no process with pid 11"):
        criu.dump(CriuDumpJob(11, images, work, leave_running=True), CriuHooks())
    with pytest.raises(CriuFailed, match="cannot open"):
        criu.dump(CriuDumpJob(10, tmp_path / "nope", work, leave_running=True), CriuHooks())


def test_criu_restore_needs_free_pids_and_inherited_fds(tmp_path: Path) -> None:
    table = FakeProcessTable()
    table.add_process(10)
    pipe = "pipe:[5]"
    table.set_stdio(10, StdioFact(10, 1, StdioKind.PIPE, pipe, True, pipe))
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table)
    with pytest.raises(CriuFailed, match="cannot read images"):
        criu.restore(CriuRestoreJob(images, work), CriuHooks())
    criu.dump(CriuDumpJob(10, images, work, leave_running=True), CriuHooks()).finish()
    with pytest.raises(CriuFailed, match="pid in use"):
        criu.restore(CriuRestoreJob(images, work), CriuHooks())
    table.remove(10)
    with pytest.raises(CriuFailed, match=r"no inherit fd for pipe:\[5\]"):
        criu.restore(CriuRestoreJob(images, work), CriuHooks())
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(CriuFailed, match="inherit fd"):
        criu.restore(CriuRestoreJob(images, work, (InheritFd(pipe, fd),)), CriuHooks())
    assert table.state(10) is PidState.FREE
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert criu.restore(CriuRestoreJob(images, work, (InheritFd(pipe, fd),)), CriuHooks()) == 10
    finally:
        os.close(fd)


def test_criu_events_and_clock(tmp_path: Path) -> None:
    events: list[str] = []
    clock = FakeClock()
    table = FakeProcessTable()
    table.add_process(10)
    images, work = _dirs(tmp_path)
    criu = FakeCriu(table, clock=clock, events=events)
    start = clock.time()
    criu.dump(CriuDumpJob(10, images, work, leave_running=False), CriuHooks()).finish()
    assert clock.time() - start == criu.frozen_s
    assert events[0] == "criu.dump 10"
    assert events[-1] == "criu.finished 10"
    assert events.index("criu.dumped 10") < events.index("criu.hook post_dump")
    assert [e for e in events if e.startswith("criu.hook")] == [
        f"criu.hook {h}" for h in DUMP_HOOKS
    ]


# ---- MemoryStore / MemoryJournal / FakeStdioProvider --------------------------------------------


def test_store_failure_injection(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path)
    store.fail_begin = StoreError("no space")
    with pytest.raises(StoreError, match="no space"):
        store.begin("ck-20240101T000000-aaaaaa")
    assert store.staged() == []
    assert store.calls == [("begin", "ck-20240101T000000-aaaaaa")]


def test_journal_refuses_what_json_cannot_store() -> None:
    journal = MemoryJournal()
    with pytest.raises(TypeError):
        journal.begin("op", {"pids": {1, 2}})
    assert list(journal.pending()) == []


def test_stdio_provider_opens_one_fd_per_key_and_closes_them(tmp_path: Path) -> None:
    provider = FakeStdioProvider()
    facts = [
        StdioFact(10, 0, StdioKind.DEVNULL, "/dev/null", False),
        StdioFact(10, 1, StdioKind.PIPE, "pipe:[1]", True, "pipe:[1]"),
        StdioFact(10, 2, StdioKind.PIPE, "pipe:[1]", True, "pipe:[1]"),
        StdioFact(11, 1, StdioKind.TTY, "/dev/pts/3", True, "tty[88:3]"),
    ]
    with provider.replacements(facts, tmp_path / "out") as inherit:
        assert [i.key for i in inherit] == ["pipe:[1]", "tty[88:3]"]
        for i in inherit:
            os.fstat(i.fd)
        assert provider.open_fds == [i.fd for i in inherit]
    assert provider.open_fds == []
    assert provider.closed == provider.opened
    assert provider.calls == [(tuple(facts), tmp_path / "out")]
    assert not (tmp_path / "out").exists()


def test_stdio_provider_closes_on_error(tmp_path: Path) -> None:
    provider = FakeStdioProvider()
    fact = StdioFact(10, 1, StdioKind.PIPE, "pipe:[1]", True, "pipe:[1]")
    with pytest.raises(RuntimeError), provider.replacements([fact], tmp_path / "out"):
        raise RuntimeError("criu failed")
    assert provider.open_fds == []
    assert len(provider.opened) == 1
