"""Output directories (``DumpRequest.files_dirs``, ``--files DIR``) over the fakes: every
regular file under them captured with the checkpoint, open or not, and put back by the
restore; the tree's own files captured once; what cannot be read said; too many files
refuse the dump with the job left running."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.domain import CheckpointRecord, DumpRequest, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import TargetRefused

from .world import JOB, JOB_TREE, World, make_world


def _out(world: World) -> Path:
    out = world.tmp / "outdir"
    (out / "saved").mkdir(parents=True)
    (out / "metrics.csv").write_bytes(b"0,a\n1,b\n")
    (out / "saved" / "step-4.bin").write_bytes(b"\x07" * 9000)
    return out


def _dump(world: World, *dirs: Path) -> CheckpointRecord:
    world.clock.advance(1.0)
    return world.service.dump(ROOT, DumpRequest(JOB, leave_running=True,
                                                files_dirs=tuple(map(str, dirs))),
                              lambda p: None)


def test_files_under_the_dirs_are_captured_with_the_tree_s_own_once(world: World) -> None:
    out = _out(world)
    log = out / "train.log"
    log.write_bytes(b"kept open\n")
    world.files.open_for_writing(JOB, log, append=True)
    record = _dump(world, out, world.tmp / "missing")
    paths = [f.path for f in record.files]
    assert sorted(paths) == sorted(map(str, (log, out / "metrics.csv",
                                             out / "saved" / "step-4.bin")))
    assert len(paths) == len(set(paths))
    assert record.files_skipped == (
        f"{world.tmp / 'missing'} (no such directory)",)


def test_a_restore_puts_them_back_and_leaves_files_made_since(world: World) -> None:
    out = _out(world)
    record = _dump(world, out)
    (out / "metrics.csv").write_bytes(b"0,a\n1,b\n2,c\n")  # appended since, then died
    (out / "saved" / "step-9.bin").write_bytes(b"new")  # made after the checkpoint
    (out / "saved" / "step-4.bin").unlink()
    for pid in JOB_TREE:
        world.processes.remove(pid)
    world.clock.advance(1.0)
    world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id),
                          lambda p: None)
    assert (out / "metrics.csv").read_bytes() == b"0,a\n1,b\n"
    assert (out / "saved" / "step-4.bin").read_bytes() == b"\x07" * 9000
    assert (out / "saved" / "step-9.bin").read_bytes() == b"new"  # never removed


def test_more_files_than_the_limit_refuse_the_dump_and_the_job_runs_on(tmp_path: Path) -> None:
    world = make_world(tmp_path, files_dir_max_files=1)
    out = _out(world)
    with pytest.raises(TargetRefused, match=r"hold more than 1 files") as refused:
        _dump(world, out)
    assert "give the job's output directory itself" in (refused.value.hint or "")
    assert set(world.states(*JOB_TREE)) == {"running"}
