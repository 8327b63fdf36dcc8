"""A stopped job never waits for the daemon's restart (docs/adr/0016).

A killing dump holds the job stopped from CRIU's end until its checkpoint is committed. The
daemon is SIGKILLed in that window and NOT restarted: its guard, a process of its own, resumes
the job within seconds (running, not stopped, not traced) and the job's output goes on. Then a
daemon starts on the same store and state: its recovery leaves the running job alone, lists
no checkpoint of it (none was committed, or the guard resumed the job while its commit was
unsure and the checkpoint goes) and leaves nothing half-written behind.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.guard.client import wait_for_guards

from .store_support import (
    Daemons,
    assert_verify_clean,
    finish,
    kill_when,
    leftovers,
    tracer_of,
    wait_criu_gone,
)
from .support import LineReader, Procs, assert_running, proc_state, with_interval, workload

pytestmark = pytest.mark.integration

RESUMED_WITHIN_S = 5.0
ATTEMPTS = 4


@pytest.fixture
def daemons(tmp_path: Path, workloads: Path) -> Iterator[Daemons]:
    del workloads
    ds = Daemons(tmp_path)
    try:
        yield ds
    finally:
        ds.close()


def stopped_untraced(pid: int) -> bool:
    """Stopped as CRIU leaves a killing dump's tree once it is done (T, no tracer)."""
    return proc_state(pid) == "T" and tracer_of(pid) == 0


def test_a_daemon_killed_mid_dump_gets_its_stopped_job_resumed_without_a_restart(
    daemons: Daemons, procs: Procs
) -> None:
    ds = daemons
    cmd = with_interval(workload("bigmem", "--mib", 256, "--rewrite-pct", 1, "--steps", 0), 50)
    for attempt in range(ATTEMPTS):
        d1 = ds.start()
        job = procs.popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL)
        assert job.stdout is not None
        reader = LineReader(job.stdout.fileno())
        reader.read_lines(3, timeout=30)
        ctl = d1.popen("dump", job.pid)
        fired = kill_when(d1, lambda pid=job.pid: stopped_untraced(pid), timeout=60,
                          also_stop=lambda c=ctl: c.poll() is not None)
        killed_at = time.monotonic()
        rc, _out, _err = finish(ctl)
        assert fired, f"the dump ended before the job was seen stopped (ckptctl rc {rc})"
        assert rc != 0, "ckptctl reported a dump its daemon was killed in the middle of"

        # No daemon now. The guard acts: resumed, or killed if the commit had completed.
        while proc_state(job.pid) in ("T", "t") and time.monotonic() - killed_at < 10:
            time.sleep(0.01)
        took = time.monotonic() - killed_at
        if proc_state(job.pid) in (None, "Z", "X"):  # killed: the kill came after the commit
            job.wait(timeout=5)
            d2 = ds.start()
            assert d2.checkpoints_of(job.pid), "killed, so its checkpoint must be listed"
            Daemons.stop(d2)
            print(f"attempt {attempt}: the daemon died after the commit; the guard killed "
                  "the job (ADR 0002); again")
            continue
        assert took < RESUMED_WITHIN_S, f"the job stayed stopped {took:.1f}s without a daemon"
        assert_running(job.pid, "(its daemon killed mid-dump, not restarted)")
        assert tracer_of(job.pid) == 0, "still traced"
        seen = len(reader.drain())
        reader.read_lines(seen + 3, timeout=10)  # its output goes on
        assert wait_for_guards(ds.state_dir, 15), "the guard did not exit after acting"
        assert "ckptd-guard" in d1.log() and "resumed" in d1.log(), d1.log()[-2000:]
        print(f"attempt {attempt}: resumed {took:.2f}s after the daemon's SIGKILL")

        # A daemon again, on the same store and state: recovery leaves the job running.
        d2 = ds.start()
        wait_criu_gone(ds.state_dir)
        assert d2.checkpoints_of(job.pid) == []
        assert_running(job.pid, "(after the next daemon's recovery)")
        seen = len(reader.drain())
        reader.read_lines(seen + 3, timeout=10)
        assert not leftovers(ds.store, ds.state_dir), leftovers(ds.store, ds.state_dir)
        assert_verify_clean(d2)
        Daemons.stop(d2)
        job.kill()
        job.wait(timeout=10)
        return
    pytest.fail(f"in {ATTEMPTS} attempts the daemon was never killed before the commit")
