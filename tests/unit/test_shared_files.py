"""Files the job writes that a process outside its tree writes too (issue 34, 3): recorded at
the dump, found live at the restore, and by default never rolled back under that writer
(``shared_files``: keep, refuse, roll-back); check-restore says what a restore will do."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.jobfiles import PutBackAll
from ckptd.domain import EventKind
from ckptd.errors import Incompatible, PreconditionFailed
from ckptd.transport.cli import convert as cli_convert
from ckptd.transport.cli import render
from ckptd.transport.grpc import convert as grpc_convert

from .world import JOB, JOB_TREE, USER, World, make_world

OUTSIDE = 4242
"""A process outside the job's tree writing its log (a second Jupyter kernel, a service)."""


def _shared_log(world: World, *, append: bool = True) -> Path:
    path = world.tmp / "job" / "shared.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"job 1\nother 1\n")
    world.files.open_for_writing(JOB, path, append=append)
    world.files.written_outside(path, OUTSIDE, "kernel")
    return path


def _die(world: World) -> None:
    for pid in JOB_TREE:
        world.processes.remove(pid)


def test_the_dump_records_the_writers_outside_the_tree_and_only_those(world: World) -> None:
    log = _shared_log(world)
    world.files.written_outside(log, JOB_TREE[1], "job")  # one of the tree's own: not listed
    alone = world.tmp / "job" / "alone.log"
    alone.write_bytes(b"x")
    world.files.open_for_writing(JOB, alone)
    record = world.dump(JOB, leave_running=True)
    by_path = {f.path: f for f in record.files}
    assert by_path[str(log)].writers == (f"pid {OUTSIDE} (kernel)",)
    assert by_path[str(log)].size_free is True
    assert by_path[str(alone)].writers == ()
    assert by_path[str(alone)].size_free is False


def test_by_default_a_file_with_a_live_writer_outside_is_left_as_it_is(world: World) -> None:
    log = _shared_log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"job 1\nother 1\njob 2\nother 2\n")  # both wrote on
    _die(world)
    report = world.restore_recipe.check(record)
    assert report.blocking == ()
    assert report.notes == (
        f"file {log} is written by pid {OUTSIDE} (kernel), outside the checkpoint: a restore "
        "leaves it as it is, not as at the checkpoint (shared_files = \"keep\")",)
    outcome = world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"job 1\nother 1\njob 2\nother 2\n"
    assert outcome.files_put_back == () and outcome.files_kept == ()
    assert outcome.files_left == (f"{log} (written by pid {OUTSIDE} (kernel))",)
    assert f"files.put_back {log}" not in world.events
    done = [e for e in world.service.events.recent() if e.kind is EventKind.RESTORE_DONE]
    assert "left as found" in done[-1].message and f"pid {OUTSIDE} (kernel)" in done[-1].message


def test_refuse_names_the_writer_and_changes_nothing(tmp_path: Path) -> None:
    world = make_world(tmp_path, shared_files="refuse")
    log = _shared_log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"job 1\nother 1\nother 2\n")
    _die(world)
    report = world.restore_recipe.check(record)
    assert len(report.blocking) == 1 and f"pid {OUTSIDE} (kernel)" in report.blocking[0]
    with pytest.raises(Incompatible, match=f"written by pid {OUTSIDE}") as refused:
        world.restore(checkpoint_id=record.id)
    assert "\n" not in str(refused.value)
    assert log.read_bytes() == b"job 1\nother 1\nother 2\n"
    assert world.criu.restore_jobs == []


def test_the_put_back_looks_again_and_refuses_a_writer_that_came_since_the_check(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path, shared_files="refuse")
    log = world.tmp / "job" / "late.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"a\n")
    world.files.open_for_writing(JOB, log, append=True)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"a\nb\n")
    assert world.restore_recipe.check(record).blocking == ()  # no writer yet
    world.files.written_outside(log, OUTSIDE, "late")  # opened it between check and put-back
    images = tmp_path / "images"
    images.mkdir()
    putback = PutBackAll(world.files, record, shared_files="refuse")
    with pytest.raises(PreconditionFailed, match=f"written by pid {OUTSIDE} \\(late\\)") as no:
        putback.run(images, "op1")
    assert f"stop pid {OUTSIDE}" in (no.value.hint or "")
    assert no.value.pid == OUTSIDE
    assert log.read_bytes() == b"a\nb\n" and putback.done == []


def test_keep_refuses_a_grown_file_criu_needs_at_its_size(world: World) -> None:
    log = _shared_log(world, append=False)  # the job overwrites it: CRIU checks its size
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"job 1\nother 1\nother 2\n")
    _die(world)
    report = world.restore_recipe.check(record)
    assert len(report.blocking) == 1 and "CRIU needs exactly 14" in report.blocking[0]
    with pytest.raises(Incompatible, match="CRIU needs exactly 14"):
        world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"job 1\nother 1\nother 2\n"


def test_roll_back_puts_it_back_all_the_same_keeping_the_version_found(tmp_path: Path) -> None:
    world = make_world(tmp_path, shared_files="roll-back")
    log = _shared_log(world)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"job 1\nother 1\nother 2\n")
    _die(world)
    assert any("rolls it back all the same" in n for n in world.restore_recipe.check(record).notes)
    outcome = world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"job 1\nother 1\n"
    assert outcome.files_left == ()
    assert [Path(k).read_bytes() for k in outcome.files_kept] == [b"job 1\nother 1\nother 2\n"]


def test_the_caller_of_the_restore_is_no_other_writer(world: World) -> None:
    """A launcher (``ckptctl run > job.log``, a batch script) hands the job its output: the
    file is put back as before."""
    log = world.tmp / "job" / "out.txt"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"1\n")
    world.files.open_for_writing(JOB, log, append=True)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"1\n2\n")
    _die(world)
    assert USER.pid is not None
    world.files.written_outside(log, USER.pid, "bash")
    world.processes.add_process(USER.pid, 1, comm="bash", uid=USER.uid)
    outcome = world.restore(USER, checkpoint_id=record.id)
    assert outcome.files_put_back == (str(log),) and outcome.files_left == ()
    assert log.read_bytes() == b"1\n"


def test_show_and_restore_print_the_writers_and_the_files_left(world: World) -> None:
    """Through the gRPC messages and ``ckptctl``'s human output; a command that does not
    print is shown quoted, on one line."""
    log = _shared_log(world)
    world.files.written_outside(log, OUTSIDE + 1, "evil\x1b[2J")
    record = world.dump(JOB, leave_running=True)
    shown = render.checkpoint_details(cli_convert.checkpoint_to_dict(grpc_convert.checkpoint(
        record)))
    [line] = [t for t in shown.splitlines() if "also written by" in t]
    assert f"pid {OUTSIDE} (kernel)" in line and "\x1b" not in line
    assert str(log) in line
    _die(world)
    outcome = world.restore(checkpoint_id=record.id)
    said = render.restore_summary(cli_convert.restore_result_to_dict(
        grpc_convert.restore_result(outcome)))
    [left] = [t for t in said.splitlines() if t.startswith("left as found: ")]
    assert str(log) in left and f"pid {OUTSIDE} (kernel)" in left and "\x1b" not in left


def test_the_checkpoints_own_live_process_is_not_another_writer(world: World) -> None:
    """A migration's source on this node (or a leave-running checkpoint's tree) still holds
    the job's file: that is the job itself, in the checkpoint; the same pid with another
    start time (a reused pid) is another writer."""
    log = world.tmp / "job" / "own.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"job 1\n")
    world.files.open_for_writing(JOB, log)
    world.files.written_outside(log, JOB, "job")  # seen from the target: the job itself
    record = world.dump(JOB, leave_running=True)
    assert all(not f.writers for f in record.files)
    report = world.restore_recipe.check(record)
    assert report.blocking == () and not any("outside the checkpoint" in n
                                              for n in report.notes), report
    world.processes.remove(JOB)
    world.processes.add_process(JOB, ppid=1, comm="reused")  # a new process at that pid
    report = world.restore_recipe.check(record)
    assert any(f"pid {JOB} (job), outside the checkpoint" in n for n in report.notes), report
