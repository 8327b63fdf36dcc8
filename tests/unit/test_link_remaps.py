"""Issue 34 (1, 2) with the fakes: CRIU's link-remap files made self-contained.

A deleted file still linked elsewhere (a spawn-context semaphore, mapped through a name glibc
unlinked while it stays ``/dev/shm/sem.mp-*``) is dumped by CRIU as a hard link
``link_remap.N`` beside it. The dump records, with the images, the name each is still linked
as, refuses to commit one linked as nothing else, and removes the links CRIU leaves after a
dump that kills; the restore links a missing one again from that name before CRIU runs and
removes it whatever the restore's outcome. (Here the fake CRIU's images name the files: the
tests play CRIU's link with ``os.link``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.adapters.criu.pathimages import read_restore_paths
from ckptd.adapters.procfs import relinks
from ckptd.adapters.procfs.jobfiles import _capturable
from ckptd.adapters.procfs.safefs import Root
from ckptd.core.ports import CriuCreates, CriuPaths
from ckptd.core.ports.criu import RELINKS_IMAGE, CriuRelink, decode_relinks
from ckptd.errors import CriuFailed, PathChanged, TargetRefused

from .world import JOB, JOB_TREE, World


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A sticky world-writable directory like /dev/shm with a semaphore's file in it."""
    if os.geteuid() != 0:
        pytest.skip("/dev/shm-like directories are root's")
    where = tmp_path / "shm"
    where.mkdir()
    where.chmod(0o1777)
    (where / "sem.mp-a").write_bytes(b"\1" + b"\0" * 31)
    return where


def _images(shm: Path, linked_as: str = "") -> CriuPaths:
    remap = str(shm / "link_remap.7")
    return CriuPaths(opened=(remap,), created=(CriuCreates(remap, "link-remap file"),),
                     relinks=(CriuRelink(remap, str(shm / "sem.Xtmp"), linked_as),))


def _same_object(a: Path, b: Path) -> bool:
    sa, sb = a.stat(), b.stat()
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_a_dump_records_what_each_link_remap_is_linked_as_and_removes_those_criu_leaves(
    world: World, shm: Path
) -> None:
    world.criu.paths = _images(shm)
    world.hooks.on["post_dump"] = lambda pid: os.link(shm / "sem.mp-a", shm / "link_remap.7")
    record = world.dump(JOB)
    assert sorted(p.name for p in shm.iterdir()) == ["sem.mp-a"], "CRIU's link is left"
    recorded = (world.store.images_dir(record.id) / RELINKS_IMAGE).read_bytes()
    assert decode_relinks(recorded) == {str(shm / "link_remap.7"): str(shm / "sem.mp-a")}


def test_a_leave_running_dump_leaves_criu_to_remove_its_links(world: World, shm: Path) -> None:
    world.criu.paths = _images(shm)
    world.hooks.on["post_dump"] = lambda pid: os.link(shm / "sem.mp-a", shm / "link_remap.7")
    world.dump(JOB, leave_running=True)  # (the real CRIU removes them as it ends)
    assert (shm / "link_remap.7").exists()


def test_a_link_remap_file_that_is_another_object_is_never_removed(shm: Path) -> None:
    (shm / "link_remap.7").write_bytes(b"someone else's")
    relink = CriuRelink(str(shm / "link_remap.7"), str(shm / "sem.Xtmp"), str(shm / "sem.mp-a"))
    root = Root.node()
    try:
        relinks.remove(root, [relink])
        assert (shm / "link_remap.7").read_bytes() == b"someone else's"
        (shm / "link_remap.7").unlink()
        os.link(shm / "sem.mp-a", shm / "link_remap.7")
        relinks.remove(root, [relink])
    finally:
        root.close()
    assert sorted(p.name for p in shm.iterdir()) == ["sem.mp-a"]


def test_a_dump_whose_link_remap_file_is_linked_as_nothing_else_is_not_committed(
    world: World, shm: Path
) -> None:
    world.criu.paths = _images(shm)
    (shm / "sem.mp-a").rename(shm / "link_remap.7")  # the object's only other name is gone
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    line = str(info.value)
    assert f"cannot checkpoint pid {JOB}: it holds the deleted file {shm}/sem.Xtmp" in line
    assert f"linked it back as {shm}/link_remap.7" in line and "nothing was committed" in line
    assert world.store.list() == []
    assert world.states(*JOB_TREE) == ["running"] * 3


@pytest.mark.parametrize("outcome", ["restored", "criu-fails", "refused-after"])
def test_a_restore_links_a_missing_link_remap_again_and_removes_it_whatever_happens(
    world: World, shm: Path, tmp_path: Path, outcome: str,
) -> None:
    record = world.dump(JOB)
    paths = _images(shm, str(shm / "sem.mp-a"))
    seen: list[bool] = []
    world.hooks.on["pre_restore"] = lambda pid: seen.append(
        _same_object(shm / "link_remap.7", shm / "sem.mp-a"))
    if outcome == "criu-fails":
        world.criu.fail_restore = CriuFailed("CRIU restore failed")
    if outcome == "refused-after":  # a ghost CRIU would make where a user can redirect it
        home = tmp_path / "home"
        home.mkdir()
        os.chown(home, 4242, 4242)
        paths = CriuPaths(paths.opened, (*paths.created,
                                         CriuCreates(str(home / "x.cr.1.ghost"), "ghost file")),
                          paths.relinks)
    world.criu.paths = paths
    if outcome == "restored":
        assert world.restore(checkpoint_id=record.id).pid == JOB
        assert seen == [True], "CRIU found the link-remap file, the semaphore's very object"
    else:
        with pytest.raises((CriuFailed, PathChanged)):
            world.restore(checkpoint_id=record.id)
    assert sorted(p.name for p in shm.iterdir()) == ["sem.mp-a"], "a link-remap file is left"
    assert world.files.open_pins == 0


def test_a_restore_whose_linked_file_is_gone_is_refused_naming_it(
    world: World, shm: Path
) -> None:
    record = world.dump(JOB)
    world.criu.paths = _images(shm, str(shm / "sem.mp-gone"))
    with pytest.raises(PathChanged) as info:
        world.restore(checkpoint_id=record.id)
    line = str(info.value)
    assert f"{shm}/sem.mp-gone is gone, and the job held it (as the deleted {shm}/sem.Xtmp)" \
        in line
    assert world.criu.restore_jobs == []
    assert sorted(p.name for p in shm.iterdir()) == ["sem.mp-a"]


def test_named_semaphores_and_criu_link_remaps_are_not_files_the_job_writes() -> None:
    assert not _capturable("/dev/shm/sem.mp-8s8rr77d")
    assert not _capturable("/dev/shm/link_remap.12")
    assert not _capturable("/data/out/link_remap.3")
    assert _capturable("/dev/shm/torch_123_456")
    assert _capturable("/data/out/sem.log")


def test_the_images_pair_each_link_remap_with_what_it_was_linked_as(tmp_path: Path) -> None:
    from tests.unit.adapters.test_pathimages import _image, _reg, _remap

    (tmp_path / "files.img").write_bytes(_image(_reg(6, "/dev/shm/sem.Xtmp"),
                                                _reg(7, "/dev/shm/link_remap.7")))
    (tmp_path / "remap-fpath.img").write_bytes(_image(_remap(6, 7, 0)))
    found = read_restore_paths(tmp_path, None)
    assert found.paths.relinks == (CriuRelink("/dev/shm/link_remap.7", "/dev/shm/sem.Xtmp"),)
    (tmp_path / RELINKS_IMAGE).write_bytes(
        b'{"linked_as": {"/dev/shm/link_remap.7": "/dev/shm/sem.mp-a"}}')
    found = read_restore_paths(tmp_path, None)
    assert found.paths.relinks == (
        CriuRelink("/dev/shm/link_remap.7", "/dev/shm/sem.Xtmp", "/dev/shm/sem.mp-a"),)
    (tmp_path / RELINKS_IMAGE).write_bytes(b"[]")
    assert read_restore_paths(tmp_path, None).unreadable == RELINKS_IMAGE
