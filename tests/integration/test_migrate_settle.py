"""Issue 33 (5): a migration whose target dies while restoring settles by itself. The target
daemon is SIGKILLed the moment its CRIU recreates the job (its root pid appears), then started
again on the same store, state directory and address; the source, its link broken during
Finish, asks it (with backoff) until it answers "not restored" — a fence there — and restores
the job here. The job runs exactly once, on the source, and its output equals an uninterrupted
run's; the source's events say where it runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .store_support import finish, kill_when, wait_criu_gone
from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_running,
    criu_path,
    proc_state,
    wait_for_done,
    wait_until,
)
from .test_migrate import Pki, free_port, start_job, start_node

pytestmark = pytest.mark.integration


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Daemons the test starts and kills itself; any still running is killed at the end."""
    started: list[Daemon] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(timeout=10)


def events_of(d: Daemon, kind: str) -> list[dict[str, Any]]:
    res = d.ctl("events", "--last", "200", "--kind", kind)
    assert res.rc == 0, res.err
    text = res.out if isinstance(res.out, str) else json.dumps(res.out)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def test_a_target_killed_while_restoring_settles_and_the_job_runs_here_exactly_once(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, pki: Pki,
    daemons: list[Daemon],
) -> None:
    a, _addr_a = start_node(start_daemon, pki, "node-a")
    b_dir = tmp_path / "node-b"
    address = f"127.0.0.1:{free_port()}"
    criu = criu_path()
    flags = [*(["--criu", criu] if criu else []), *pki.flags("node-b", ["127.0.0.1"]),
             "--peer-listen", address, "--store", str(b_dir / "store"),
             "--state-dir", str(b_dir / "state")]

    def start_b(n: int) -> Daemon:
        (b_dir / f"d{n}").mkdir(parents=True)
        d = Daemon(b_dir / f"d{n}", *flags, config={"node": "node-b", "gc_grace_s": 0})
        daemons.append(d)
        return d

    b = start_b(0)
    out_path = tmp_path / "job.out"
    pid, ref = start_job(procs, out_path)
    migrating = a.popen("migrate", pid, "--to", address)
    try:
        # the source killed the job after its dump (its zombie reaped); b's CRIU recreates it
        # with its pid: b dies then, while restoring, before the restored tree may run
        wait_until(lambda: proc_state(pid) is None, 60, "the source to dump and kill the job")
        assert kill_when(b, lambda: alive(pid), 60,
                         also_stop=lambda: migrating.poll() is not None), (
            "b never began restoring the job", migrating.poll())
        wait_criu_gone(b_dir / "state")
        assert "restored migrated checkpoint" not in b.log(), "b finished its restore"
        b = start_b(1)  # recovers its half-done restore, then answers the source
        rc, out, err = finish(migrating, timeout=240)
    finally:
        if migrating.poll() is None:
            migrating.kill()
            migrating.wait()

    assert rc == 1 and out == "", (rc, out, err)
    assert len(err.splitlines()) == 1, err
    assert "said it never restored it" in err, err
    assert f"the tree was restored on this node as pid {pid}" in err, err
    procs.add(pid)
    assert_running(pid, "restored on the source")
    [settled] = events_of(a, "migrate.settled")
    assert settled["fields"]["restored_on"] == "source", settled
    assert settled["fields"]["node"] == "node-b" and settled["pid"] == pid, settled
    [checkpoint] = assert_ok(a.ctl("list"), "list on a")
    assert settled["checkpoint_id"] == checkpoint["id"]
    assert assert_ok(b.ctl("list"), "list on b") == [], "b never committed it"
    assert "fenced" in b.log(), "b answered from its durable record, and fenced it"
    assert wait_for_done(out_path, timeout=60) == ref, "the job continues exactly, once"
