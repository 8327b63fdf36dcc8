"""ckptd.adapters.criu.containers without containers: the command line that enters a
container, the pstree reading, the cgroup directories of this process."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from ckptd._gen.criu import pstree_pb2
from ckptd.adapters.criu.containers import (
    ENTERED,
    MNTNS_FD_ENV,
    Container,
    ContainerError,
    cgroup_dirs,
    image_pids,
)
from ckptd.adapters.criu.images import IMG_COMMON_MAGIC, PSTREE_MAGIC


def fake_container(cgroups: tuple[Path, ...] = (Path("/sys/fs/cgroup/k8s/pod1"),)) -> Container:
    fds = {kind: 10 + i for i, kind in enumerate(ENTERED)}
    return Container(pid=4242, start_time=1, inodes={}, cgroups=cgroups, _fds=fds, _pidfd=-1)


def test_command_moves_into_cgroups_then_enters_from_pinned_descriptors() -> None:
    line, fds = fake_container().command(["criu", "dump", "-t", "7"])
    assert line[:5] == ["sh", "-c", line[2], "ckptd-enter", "/sys/fs/cgroup/k8s/pod1"]
    rest = line[line.index("--") + 1:]
    assert rest[0] == "nsenter"
    enter = rest[1:rest.index("--")]
    assert enter == ["--pid=/proc/self/fd/10", "--net=/proc/self/fd/11",
                     "--ipc=/proc/self/fd/12", "--uts=/proc/self/fd/13",
                     "--cgroup=/proc/self/fd/14", "--mount=/proc/self/fd/15"]
    assert rest[rest.index("--") + 1:] == ["criu", "dump", "-t", "7"]
    assert fds == (10, 11, 12, 13, 14, 15)


def test_with_preload_the_mount_namespace_is_entered_after_loading() -> None:
    line, fds = fake_container(cgroups=()).command(["criu", "restore"], preload=Path("/s.so"))
    assert line[0] == "nsenter" and not any(a.startswith("--mount") for a in line)
    assert line[line.index("--") + 1:] == [
        "env", f"{MNTNS_FD_ENV}=15", "LD_PRELOAD=/s.so", "criu", "restore"]
    assert 15 in fds


def test_only_the_pid_namespace_without_cgroups() -> None:
    line, fds = fake_container().command(["true"], enter=("pid",), cgroups=False)
    assert line == ["nsenter", "--pid=/proc/self/fd/10", "--", "true"]
    assert fds == (10,)


def _entry(pid: int, threads: list[int]) -> bytes:
    raw = pstree_pb2.pstree_entry(pid=pid, ppid=0, pgid=pid, sid=pid, threads=threads)
    data = raw.SerializeToString()
    return struct.pack("<I", len(data)) + data


def test_image_pids_lists_processes_and_threads(tmp_path: Path) -> None:
    (tmp_path / "pstree.img").write_bytes(
        struct.pack("<II", IMG_COMMON_MAGIC, PSTREE_MAGIC)
        + _entry(1001, [1001, 1003]) + _entry(1002, [1002]))
    assert image_pids(tmp_path) == (1001, 1003, 1002)


def test_image_pids_refuses_what_is_not_a_pstree(tmp_path: Path) -> None:
    (tmp_path / "pstree.img").write_bytes(b"nonsense")
    with pytest.raises(ContainerError, match="not a CRIU process tree image"):
        image_pids(tmp_path)


def test_cgroup_dirs_of_this_process_exist() -> None:
    dirs = cgroup_dirs(os.getpid())
    if not dirs:
        pytest.skip("no cgroup hierarchy is mounted here")
    assert all(d.is_dir() and (d / "cgroup.procs").exists() for d in dirs)
