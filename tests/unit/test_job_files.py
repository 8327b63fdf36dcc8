"""Files the job writes, over the fakes: captured while CRIU holds the tree, put back before
CRIU restores it, the version found kept aside, everything undone when the restore fails."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from ckptd.core.ports import NotCaptured, Precopy, PutBack, WrittenFile
from ckptd.core.ports.asides import AsideRecord
from ckptd.domain import Caller, CapturedFile, PidState
from ckptd.domain.model import ROOT
from ckptd.errors import CriuFailed, Incompatible, PreconditionFailed, TargetRefused
from ckptd.testing._asides import FakeAsideLog
from ckptd.transport.grpc.status import details_for

from .world import JOB, JOB_TREE, World, make_world


def _log(world: World, content: bytes = b"step 1\nstep 2\n", name: str = "train.log") -> Path:
    path = world.tmp / "job" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    world.files.open_for_writing(JOB, path)
    return path


def _die(world: World) -> None:
    for pid in JOB_TREE:
        world.processes.remove(pid)


def test_a_leave_running_checkpoint_captures_the_files_the_tree_writes(world: World) -> None:
    log = _log(world)
    state = _log(world, b"\x01" * 5000, "state.bin")
    record = world.dump(JOB, leave_running=True)
    assert [(f.path, f.size) for f in record.files] == [(str(state), 5000), (str(log), 14)]
    assert record.files_skipped == ()
    # captured while CRIU held the tree frozen: after the images, before CRIU let go
    events = world.events
    assert (events.index(f"criu.dumped {JOB}") < events.index(f"files.capture {log}")
            < events.index(f"criu.finished {JOB}"))


def test_restore_after_the_job_wrote_on_and_died_puts_files_back_and_keeps_the_newer(
    world: World,
) -> None:
    log = _log(world)
    state = _log(world, b"A" * 6000, "state.bin")
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"step 1\nstep 2\nstep 3\n")  # the job wrote on ...
    state.write_bytes(b"B" * 100)  # ... rewrote its state
    _die(world)  # ... and died
    outcome = world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"step 1\nstep 2\n"
    assert state.read_bytes() == b"A" * 6000
    assert sorted(outcome.files_put_back) == sorted([str(log), str(state)])
    kept = {k.split(".ckptd-")[0]: Path(k).read_bytes() for k in outcome.files_kept}
    assert kept == {str(log): b"step 1\nstep 2\nstep 3\n", str(state): b"B" * 100}
    # the files were put back before CRIU ran
    assert world.events.index(f"files.put_back {log}") < world.events.index("criu.restore")


def test_an_unchanged_file_is_left_alone_and_a_missing_one_is_recreated(world: World) -> None:
    log = _log(world)
    state = _log(world, b"S" * 10, "state.bin")
    record = world.dump(JOB, leave_running=True)
    state.unlink()
    _die(world)
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.files_put_back == (str(state),)
    assert outcome.files_kept == ()
    assert state.read_bytes() == b"S" * 10
    assert log.read_bytes() == b"step 1\nstep 2\n"
    assert not list(log.parent.glob("*.ckptd-*"))


def test_a_failed_criu_restore_leaves_every_file_as_it_was_found(world: World) -> None:
    log = _log(world)
    state = _log(world, b"old", "state.bin")
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"newer log\n")
    state.unlink()
    _die(world)
    world.criu.fail_restore = CriuFailed("CRIU restore failed: boom")
    with pytest.raises(CriuFailed):
        world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"newer log\n"
    assert not state.exists()
    assert not list(log.parent.glob("*.ckptd-*"))
    assert f"files.undo {log}" in world.events


def test_a_file_that_cannot_be_put_back_undoes_those_before_it(world: World) -> None:
    first = _log(world, b"first", "a.log")
    second = _log(world, b"second", "b.log")
    record = world.dump(JOB, leave_running=True)
    first.write_bytes(b"first, later")
    second.write_bytes(b"second, later")
    _die(world)
    world.files.fail_put_back.add(str(second))
    with pytest.raises(PreconditionFailed, match="cannot put back"):
        world.restore(checkpoint_id=record.id)
    assert first.read_bytes() == b"first, later"
    assert second.read_bytes() == b"second, later"
    assert world.criu.restore_jobs == []


def test_check_restore_names_the_files_it_will_put_back_and_those_it_cannot(
    world: World,
) -> None:
    log = _log(world)
    gone = _log(world, b"x", "sub/state.bin")
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"more")
    gone.unlink()
    gone.parent.rmdir()
    report = world.restore_recipe.check(record)
    assert report.blocking == (
        f"file {gone} cannot be put back: its directory {gone.parent} is missing",
    )
    assert len(report.notes) == 1 and str(log) in report.notes[0]
    _die(world)
    with pytest.raises(Incompatible, match="cannot be put back"):
        world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"more"  # refused before anything was touched
    assert world.criu.restore_jobs == []


def test_a_file_over_the_limit_is_refused_before_the_tree_is_frozen(tmp_path: Path) -> None:
    world = make_world(tmp_path, file_capture_limit=100)
    big = _log(world, b"x" * 101, "big.log")
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB, leave_running=True)
    assert str(big) in info.value.message and "file_capture_limit" in (info.value.hint or "")
    assert "\n" not in info.value.message
    assert world.criu.dump_jobs == []
    assert world.states(*JOB_TREE) == ["running"] * 3


def test_a_file_over_the_limit_is_skipped_when_so_configured(tmp_path: Path) -> None:
    world = make_world(tmp_path, file_capture_limit=100, file_capture_oversize="skip")
    small = _log(world, b"small", "small.log")
    big = _log(world, b"x" * 101, "big.log")
    record = world.dump(JOB, leave_running=True)
    assert [f.path for f in record.files] == [str(small)]
    assert len(record.files_skipped) == 1 and str(big) in record.files_skipped[0]


def test_a_file_that_cannot_be_read_without_harm_is_recorded_as_not_captured(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34 (6): a file leased through a write-only descriptor (the adapter's
    ``NotCaptured``): the dump goes on, the others captured, that one listed with why."""
    log = _log(world)
    leased = _log(world, b"x" * 10, "leased.bin")
    capture = world.files.capture

    def refuse(
        file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        if file.path == str(leased):
            raise NotCaptured("leased by the job through a write-only descriptor")
        return capture(file, dest, precopy)

    monkeypatch.setattr(world.files, "capture", refuse)
    record = world.dump(JOB, leave_running=True)
    assert [f.path for f in record.files] == [str(log)]
    assert record.files_skipped == (
        f"{leased} (leased by the job through a write-only descriptor)",)


def test_a_file_growing_over_the_limit_while_frozen_aborts_and_the_tree_runs_on(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path, file_capture_limit=100)
    log = _log(world, b"x" * 10)
    world.hooks.on["post_dump"] = lambda _pid: log.write_bytes(b"y" * 200)
    with pytest.raises(TargetRefused):
        world.dump(JOB)
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.store.list() == []


def test_kill_mode_dump_captures_files_too(world: World) -> None:
    log = _log(world)
    record = world.dump(JOB)
    assert [f.path for f in record.files] == [str(log)]
    assert world.processes.status(JOB).state in (PidState.FREE, PidState.ZOMBIE)


def test_the_restore_event_names_the_files_put_back_and_kept(world: World) -> None:
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"more")
    _die(world)
    outcome = world.restore(checkpoint_id=record.id)
    done = [e for e in world.service.events.recent() if e.kind.value == "restore.done"]
    assert str(log) in done[-1].message and outcome.files_kept[0] in done[-1].message


def test_an_append_only_log_is_copied_before_the_freeze_and_only_its_tail_during(
    world: World,
) -> None:
    log = world.tmp / "job" / "append.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"x" * 10000)
    world.files.open_for_writing(JOB, log, append=True)
    world.hooks.on["pre_dump"] = lambda _pid: log.write_bytes(log.read_bytes() + b"tail\n")
    record = world.dump(JOB, leave_running=True)
    events = world.events
    assert events.index(f"files.precopy {log}") < events.index(f"criu.dump {JOB}")
    assert events.index(f"criu.dumped {JOB}") < events.index(f"files.capture {log} (tail)")
    (captured,) = record.files
    assert captured.size == 10005
    log.write_bytes(b"other")
    _die(world)
    world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"x" * 10000 + b"tail\n"


def test_a_precopied_file_no_longer_written_leaves_no_image(world: World) -> None:
    log = world.tmp / "job" / "append.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"x" * 100)
    world.files.open_for_writing(JOB, log, append=True)
    world.hooks.on["pre_dump"] = lambda _pid: world.files.writes.clear()
    record = world.dump(JOB, leave_running=True)
    assert record.files == ()
    assert not any("ckptd-file-" in str(p) for p in world.tmp.rglob("ckptd-file-*"))


def test_after_each_restore_only_the_newest_asides_are_kept(tmp_path: Path) -> None:
    """Issue 24 (5): copies kept aside are never removed — now ``aside_keep`` per file."""
    world = make_world(tmp_path, aside_keep=2)
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    kept: list[str] = []
    for i in range(3):
        log.write_bytes(b"later %d\n" % i)
        _die(world)
        outcome = world.restore(checkpoint_id=record.id)
        kept += outcome.files_kept
        time.sleep(0.01)  # distinct mtimes
    left = sorted(str(p) for p in log.parent.glob("train.log.ckptd-*"))
    assert left == sorted(kept[1:]), "the oldest copy is removed, the two newest kept"
    assert Path(kept[-1]).read_bytes() == b"later 2\n"
    assert any(e.startswith("files.remove_aside") for e in world.events)


def test_retention_removes_only_recorded_copies_by_identity(tmp_path: Path) -> None:
    """Issue 33 (6): retention (``aside_keep``) counts and removes only the copies restores
    recorded: a file merely named like one (planted, old) stays, and so does another file
    put at a recorded copy's name (that record forgotten)."""
    world = make_world(tmp_path, aside_keep=1)
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    planted = log.parent / "train.log.ckptd-planted"
    planted.write_bytes(b"someone else's")
    os.utime(planted, (1.0, 1.0))  # the oldest by far
    log.write_bytes(b"later 0\n")
    _die(world)
    (first,) = world.restore(checkpoint_id=record.id).files_kept
    other = log.parent / "other"  # another file (made while the copy exists: another
    other.write_bytes(b"another file")  # inode) put at the recorded copy's name
    os.replace(other, first)
    log.write_bytes(b"later 1\n")
    _die(world)
    (second,) = world.restore(checkpoint_id=record.id).files_kept
    assert planted.read_bytes() == b"someone else's"
    assert Path(first).read_bytes() == b"another file"
    assert Path(second).read_bytes() == b"later 1\n"
    assert [r.path for r in _aside_log(world).records()] == [second]


def _aside_log(world: World) -> FakeAsideLog:
    log = world.restore_recipe.parts.asides
    assert isinstance(log, FakeAsideLog)
    return log


def test_a_restore_records_each_copy_it_kept_aside_as_made(world: World) -> None:
    """Issue 33 (6): the copies a restore kept aside are recorded (path, identity, owner,
    restore, checkpoint) before its result is given: ``ckptctl asides`` acts only on those.
    A caller sees the records of its own checkpoints; root every one."""
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"written on")
    _die(world)
    before = world.clock.time()
    outcome = world.restore(checkpoint_id=record.id)
    (aside,) = outcome.files_kept
    made = os.stat(aside)
    (recorded,) = _aside_log(world).records()
    assert before < recorded.made <= world.clock.time()  # when it was put back
    assert recorded == AsideRecord(
        path=aside, dev=made.st_dev, ino=made.st_ino, uid=made.st_uid,
        restore_id=aside.rsplit(".ckptd-", 1)[1], checkpoint_id=record.id, owner=record.uid,
        made=recorded.made, in_container=False)
    assert world.service.asides(ROOT) == [recorded]
    assert world.service.asides(ROOT, record.id) == [recorded]
    assert world.service.asides(ROOT, "ck-20200101T000000-000000") == []
    assert world.service.asides(Caller(uid=record.uid + 1, pid=4242)) == []


def test_the_copies_are_recorded_before_the_restores_journal_entry_ends(world: World) -> None:
    """A daemon killed once the restore stands but before its entry ended leaves the copies
    recorded (else neither retention nor ``ckptctl asides`` would ever remove them)."""
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"written on")
    _die(world)
    aside_log = _aside_log(world)
    real_add = aside_log.add
    pending_then: list[list[str]] = []

    def add(records: Sequence[AsideRecord]) -> None:
        pending_then.append([op for op, _ in world.journal.pending()])
        real_add(records)

    setattr(aside_log, "add", add)  # noqa: B010 (an instance's method replaced)
    outcome = world.restore(checkpoint_id=record.id)
    (op_id,) = {k.rsplit(".ckptd-", 1)[1] for k in outcome.files_kept}
    assert pending_then == [[op_id]], pending_then
    assert list(world.journal.pending()) == []


def test_the_copies_retention_removes_are_forgotten_and_a_record_failure_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    world = make_world(tmp_path, aside_keep=1)
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    kept: list[str] = []
    for i in range(2):
        log.write_bytes(b"later %d\n" % i)
        _die(world)
        kept += world.restore(checkpoint_id=record.id).files_kept
        time.sleep(0.01)  # distinct mtimes
    assert not Path(kept[0]).exists()
    assert [r.path for r in _aside_log(world).records()] == [kept[1]]  # the removed forgotten

    _aside_log(world).fail_add = OSError(errno.ENOSPC, "No space left on device")
    log.write_bytes(b"later 2\n")
    _die(world)
    outcome = world.restore(checkpoint_id=record.id)  # the restore stands
    assert outcome.files_kept and Path(outcome.files_kept[0]).exists()
    assert "were not recorded" in caplog.text and outcome.files_kept[0] in caplog.text


def _put_back_meets(world: World, effect: Callable[[PutBack], None]) -> None:
    """``effect`` runs each time the put-back is about to make what ``PutBack`` names (the
    exact point a racing process or a filling disk would act)."""
    real = world.files.put_back

    def put_back(captured: CapturedFile, content: Path, aside: str, uid: int, gid: int,
                 before: Callable[[PutBack], None]) -> PutBack | None:
        def hooked(done: PutBack) -> None:
            before(done)
            effect(done)
        return real(captured, content, aside, uid, gid, hooked)

    setattr(world.files, "put_back", put_back)  # noqa: B010 (an instance's method replaced)


def test_a_name_taken_while_the_file_is_put_back_is_one_line_saying_what_to_do(
    world: World,
) -> None:
    """Issue 33 (7): a race met at put-back (here the aside's temporary name taken by another
    process just before the put-back creates it: EEXIST) came back `internal error: [Errno
    17] ...`; now one line: what changed and what to do. Every file is as it was found."""
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"written on")
    _die(world)

    def plant(done: PutBack) -> None:
        if done.temp:
            Path(done.temp).write_bytes(b"someone else's")

    _put_back_meets(world, plant)
    with pytest.raises(PreconditionFailed) as info:
        world.restore(checkpoint_id=record.id)
    line = details_for(info.value)
    assert line.startswith(f"cannot put back {log}: it or its directory changed while it was "
                           "put back (file exists ("), line
    assert "restore again" in line and "every file as it was found" in line
    assert "Errno" not in line and "internal error" not in line and "\n" not in line
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EEXIST
    assert log.read_bytes() == b"written on"
    assert world.criu.restore_jobs == []


def test_a_full_file_system_at_put_back_is_one_line_saying_what_to_do(world: World) -> None:
    log = _log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"written on")
    _die(world)

    def full(done: PutBack) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), done.temp)

    _put_back_meets(world, full)
    with pytest.raises(PreconditionFailed) as info:
        world.restore(checkpoint_id=record.id)
    line = details_for(info.value)
    assert line.startswith(f"cannot put back {log}: no space left on device on its file "
                           "system"), line
    assert "free space there" in line and "restore again" in line
    assert "Errno" not in line and "internal error" not in line
    assert log.read_bytes() == b"written on"
