"""Issue 33.1 with the fakes: the restore's paths step and its post-restore check; the dump's
refusal of link-remap files where a user could redirect CRIU.

CRIU resolves what the restored tree holds by path, as root; the recipe pins each object
before CRIU runs (``JobFiles.pin``) and, at post-restore, before the tree runs, compares what
every restored process holds with the pinned objects. A path that leads elsewhere undoes the
restore (tree killed, files as found, pins released, checkpoint kept); a path with a link on
the way, or a directory CRIU would create in that a user owns, refuses it before CRIU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.core.ports import CriuCreates, CriuPaths
from ckptd.errors import CorruptCheckpoint, PathChanged, TargetRefused

from .world import JOB, JOB_TREE, World


def _objects(tmp: Path) -> tuple[Path, Path]:
    data = tmp / "data"
    data.mkdir()
    (data / "obj").write_bytes(b"the job's\n")
    vault = tmp / "vault"
    vault.mkdir()
    (vault / "obj").write_bytes(b"root's\n")
    return data, vault


def test_what_criu_opened_elsewhere_undoes_the_restore_before_the_tree_runs(
    world: World, tmp_path: Path
) -> None:
    data, vault = _objects(tmp_path)
    record = world.dump(JOB)
    world.criu.paths = CriuPaths(opened=(str(data / "obj"),))

    def swap(pid: int) -> None:  # after ckptd pinned, before CRIU opens: a swapped directory
        os.rename(data, tmp_path / "data.old")
        os.symlink(vault, data)

    world.hooks.on["pre_restore"] = swap
    world.files.opens[JOB] = [("fd 3", str(data / "obj"))]
    with pytest.raises(PathChanged) as info:
        world.restore(checkpoint_id=record.id)
    line = str(info.value)
    assert line.startswith(f"restore undone: restored pid {JOB}'s fd 3 is "), line
    assert "vault/obj" in line and "not what the checkpoint names" in line
    assert info.value.checkpoint_id == record.id
    assert world.states(*JOB_TREE) == ["free"] * 3  # killed before it ran
    assert world.files.open_pins == 0
    assert world.store.get(record.id).id == record.id  # kept


def test_the_same_objects_restore(world: World, tmp_path: Path) -> None:
    data, _ = _objects(tmp_path)
    record = world.dump(JOB)
    world.criu.paths = CriuPaths(opened=(str(data / "obj"), str(data)))
    world.files.opens[JOB] = [("fd 3", str(data / "obj")), ("cwd", str(data))]
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.pid == JOB
    assert world.files.pinned == [world.criu.paths]
    assert world.files.open_pins == 0


def test_a_link_on_the_way_refuses_before_criu_runs(world: World, tmp_path: Path) -> None:
    data, vault = _objects(tmp_path)
    record = world.dump(JOB)
    os.rename(data, tmp_path / "data.old")
    os.symlink(vault, data)
    world.criu.paths = CriuPaths(opened=(str(data / "obj"),))
    with pytest.raises(PathChanged) as info:
        world.restore(checkpoint_id=record.id)
    assert "is a symbolic link" in str(info.value)
    assert world.criu.restore_jobs == []
    assert world.files.open_pins == 0


def test_a_directory_a_user_owns_is_refused_for_what_criu_creates(
    world: World, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)
    record = world.dump(JOB)
    world.criu.paths = CriuPaths(created=(CriuCreates(str(home / "x.cr.1.ghost"), "ghost file"),))
    with pytest.raises(PathChanged) as info:
        world.restore(checkpoint_id=record.id)
    assert "CRIU would create or remove the ghost file" in str(info.value)
    assert f"{home} is owned by uid 4242" in str(info.value)
    assert world.criu.restore_jobs == []


def test_images_that_cannot_be_read_refuse(world: World) -> None:
    record = world.dump(JOB)
    world.criu.fail_restore_paths = CorruptCheckpoint("files.img cannot be read")
    with pytest.raises(CorruptCheckpoint):
        world.restore(checkpoint_id=record.id)
    assert world.criu.restore_jobs == []


def test_a_dump_never_has_criu_link_back_a_file_where_a_user_can_redirect_it(
    world: World, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 4242, 4242)
    world.files.hold_relinked(JOB, str(home / "sem.tmp"))
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    line = str(info.value)
    assert f"cannot checkpoint pid {JOB}: it holds {home}/sem.tmp (deleted, still linked" in line
    assert "link-remap file" in line and f"{home} is owned by uid 4242" in line
    assert world.criu.dump_jobs == []
    assert world.states(*JOB_TREE) == ["running"] * 3


def test_a_dump_links_back_in_a_sticky_root_directory(world: World, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("/dev/shm-like directories are root's")
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)  # like /dev/shm: glibc's named semaphores lie there
    world.files.hold_relinked(JOB, str(shm / "sem.tmp"))
    assert world.dump(JOB).pid == JOB
