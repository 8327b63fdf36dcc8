"""Dump a running workload (killing it), restore it: its output goes on bit for bit.

Each test runs the workload once uninterrupted for the reference, then again with stdout on a
pipe the test reads: k lines, ``ckptctl dump``, the rest of the pipe, ``ckptctl restore``,
then the restore's output file (the pipe's replacement) until ``done``. Lines before the dump
plus lines after the restore must equal the reference exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .flows import dump_and_restore_via_pipe
from .support import (
    Daemon,
    Procs,
    children,
    workload,
)

pytestmark = pytest.mark.integration


def test_counter_single_thread_with_memory(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd = workload("counter", "--steps", 40, "--mem-mib", 8)
    ck, _ = dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd)
    assert [p["pid"] for p in ck["processes"]] == [ck["pid"]]
    assert ck["bytes"] > 8 * 2**20, "an 8 MiB heap must be in the images"


def test_threads_multi_threaded(daemon: Daemon, procs: Procs, tmp_path: Path) -> None:
    def four_workers_and_main(pid: int) -> None:
        status = Path(f"/proc/{pid}/status").read_text()
        assert "Threads:\t5\n" in status, "restored process must have its 5 threads"

    cmd = workload("threads", "--steps", 40, "--threads", 4)
    ck, _ = dump_and_restore_via_pipe(
        daemon, procs, tmp_path, cmd, after_restore=four_workers_and_main
    )
    assert ck["processes"][0]["threads"] == 5


def test_python_pyloop(daemon: Daemon, procs: Procs, tmp_path: Path) -> None:
    cmd = workload("pyloop.py", "--steps", 40)
    dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd)


def test_process_tree_with_pipes(daemon: Daemon, procs: Procs, tmp_path: Path) -> None:
    def three_children(pid: int) -> None:
        assert len(children(pid)) == 3, "the restored parent must have its 3 children"

    cmd = workload("tree", "--steps", 40, "--children", 3)
    ck, res = dump_and_restore_via_pipe(
        daemon, procs, tmp_path, cmd, after_restore=three_children
    )
    pids = [p["pid"] for p in ck["processes"]]
    assert len(pids) == 4 and pids[0] == ck["pid"]
    assert all(p["ppid"] == ck["pid"] for p in ck["processes"][1:])
    del res


def test_resources_files_mmap_shm_socketpair(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    ref_dir = tmp_path / "ref"
    data.mkdir()
    ref_dir.mkdir()
    cmd = workload("resources", "--steps", 40, "--dir", data)
    ref_cmd = workload("resources", "--steps", 40, "--dir", ref_dir)
    ck, _ = dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd, ref_cmd=ref_cmd)
    assert len(ck["processes"]) == 2, "resources forks one child"
    assert (data / "data.bin").read_bytes() == (ref_dir / "data.bin").read_bytes()
    assert (data / "mapped.bin").read_bytes() == (ref_dir / "mapped.bin").read_bytes()
