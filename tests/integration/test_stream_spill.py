"""Issue 25, point 1, through the daemon: a streamed dump whose pages come faster than the store
takes them spills them (to RAM, the daemon's memfd, by default; to the staging's file with
``spill_ram_mib = 0``: issue 35) and lets the tree go; they are ingested after the thaw. The
daemon SIGKILLed while it ingests the spill: the job (dumped ``--leave-running``) runs on, and
the next daemon lists nothing, leaves no staging, spill or lease behind."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.core.store.streaming import SPILL_NAME

from .store_support import (
    Daemons,
    assert_verify_clean,
    finish,
    kill_when,
    leftovers,
    staging_dirs,
    tracer_of,
    wait_criu_gone,
)
from .support import LineReader, Procs, assert_ok, assert_running, with_interval, workload

pytestmark = pytest.mark.integration


@pytest.fixture
def daemons(tmp_path: Path, workloads: Path) -> Iterator[Daemons]:
    del workloads
    ds = Daemons(tmp_path)
    try:
        yield ds
    finally:
        ds.close()


def _spills(state_dir: Path) -> list[Path]:
    """Spill files in either staging (RAM when the whole dump fits there, else disk)."""
    return [p for d in staging_dirs(state_dir) for p in d.glob(f"*/{SPILL_NAME}")]


def _ram_spills(daemon_pid: int) -> list[str]:
    """The daemon's spill memfds (``/memfd:ckptd-spill``, in no filesystem)."""
    found = []
    for fd in Path(f"/proc/{daemon_pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("/memfd:ckptd-spill"):
                found.append(str(fd))
    return found


def _ingesting_after_thaw(state_dir: Path, daemon_pid: int, in_ram: bool, pid: int) -> bool:
    """The dump's pages are in the spill (RAM or file) and CRIU no longer holds the tree."""
    spilled = _ram_spills(daemon_pid) if in_ram else _spills(state_dir)
    return bool(spilled) and tracer_of(pid) == 0


@pytest.mark.parametrize("in_ram", [True, False], ids=["spill-in-ram", "spill-in-file"])
def test_daemon_killed_while_ingesting_the_spill_lists_nothing_and_the_job_runs(
    daemons: Daemons, procs: Procs, in_ram: bool
) -> None:
    ds = daemons
    d1 = ds.start(config=None if in_ram else {"spill_ram_mib": 0})
    cmd = workload("bigmem", "--mib", 768, "--random", "--steps", 0)
    job = procs.popen(with_interval(cmd, 50), stdin=subprocess.DEVNULL,
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert job.stdout is not None
    reader = LineReader(job.stdout.fileno())
    reader.read_lines(3, timeout=60)
    ctl = d1.popen("dump", job.pid, "--leave-running")
    fired = kill_when(d1, functools.partial(_ingesting_after_thaw, ds.state_dir, d1.proc.pid,
                                            in_ram, job.pid),
                      timeout=60, also_stop=lambda: ctl.poll() is not None)
    rc, _out, _err = finish(ctl)
    assert fired, f"the dump ended (ckptctl rc {rc}) without spilling: nothing tested"
    assert rc != 0
    assert_running(job.pid, "a job whose dump died while its spill was ingested")
    seen = len(reader.drain())
    reader.read_lines(seen + 3, timeout=10)  # it makes progress: it was let go

    d2 = ds.start()
    wait_criu_gone(ds.state_dir)
    assert assert_ok(d2.ctl("list"), "list") == []
    assert not _spills(ds.state_dir)
    assert not leftovers(ds.store, ds.state_dir), leftovers(ds.store, ds.state_dir)
    assert_verify_clean(d2, [])
    assert_running(job.pid, "after the restart")
    Daemons.stop(d2)
    job.kill()
    job.wait(timeout=10)
