"""Restored jobs belong to their caller, not to the daemon (docs/adr/0010), with real CRIU.

``ckptctl restore`` run from a process in a cgroup the test made: every restored process is
in that cgroup (CRIU was placed there before it created them), none in the daemon's; the
daemon is stopped (SIGTERM) and started again, and the job runs on and ends exactly like an
uninterrupted run. A restore asked from the daemon's own cgroup gets a cgroup of its own under
``jobs_cgroup``, which outlives daemon restarts too and is removed once empty.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import (
    CKPTCTL,
    TEST_CGROUPS,
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_running,
    cgroup_of,
    cgroup_v2_mount,
    descendants,
    is_alive,
    reference,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 60
INTERVAL = 40


@pytest.fixture
def mount(workloads: Path) -> Path:
    del workloads  # built once per session
    found = cgroup_v2_mount()
    if found is None:
        pytest.skip("no cgroup v2 hierarchy mounted here")
    return found


def _rmdir(directory: Path) -> None:
    for _ in range(250):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # a killed process leaves it a moment after it died
            time.sleep(0.02)
    raise AssertionError(f"cgroup {directory} stays populated")


@pytest.fixture
def make_cgroup(mount: Path) -> Iterator[Callable[[str], str]]:
    """``make_cgroup(name) -> cgroup path``: leaves of the test's own, removed at the end
    (their processes are gone by then: ``procs`` is torn down first)."""
    made: list[Path] = []

    def make(name: str) -> str:
        path = f"{TEST_CGROUPS}/{name}-{secrets.token_hex(3)}"
        made.append(mount / path.lstrip("/"))
        made[-1].mkdir(parents=True)
        return path

    try:
        yield make
    finally:
        for directory in made:
            _rmdir(directory)


def _in_cgroup(cgroup: str | None, argv: list[str]) -> list[str]:
    """``argv`` run by a process that first moves itself into ``cgroup`` (None: it stays in
    the test's): a shell writes its own pid into the cgroup, then becomes ``argv``."""
    if cgroup is None:
        return argv
    mount = cgroup_v2_mount()
    assert mount is not None
    procs_file = mount / cgroup.lstrip("/") / "cgroup.procs"
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs_file), *argv]


class Job:
    """The ``tree`` workload (a root and two children printing steps) started in ``cgroup``,
    dumped (so it stops) after a few lines; ``pre`` is what it printed until then."""

    def __init__(self, procs: Procs, daemon: Daemon, cgroup: str | None = None) -> None:
        cmd = workload("tree", "--steps", STEPS, "--children", 2)
        self.ref = reference(with_interval(cmd, 0))
        proc = procs.popen(_in_cgroup(cgroup, with_interval(cmd, INTERVAL)),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        reader = LineReader(proc.stdout.fileno())
        reader.read_lines(4)
        if cgroup is not None:
            assert cgroup_of(proc.pid) == cgroup
        self.ck = assert_ok(daemon.ctl("dump", proc.pid), "dump")
        self.pre = reader.read_to_eof()
        proc.wait(timeout=10)


def _restore_from(daemon: Daemon, cgroup: str | None, checkpoint_id: str) -> dict[str, Any]:
    """``ckptctl restore`` asked from ``cgroup`` (None: the test's, the daemon's)."""
    ctl = [str(CKPTCTL), "--socket", str(daemon.socket), "--json", "restore", checkpoint_id]
    out = subprocess.run(_in_cgroup(cgroup, ctl), capture_output=True, text=True, timeout=90,
                         stdin=subprocess.DEVNULL, cwd="/", check=False)
    assert out.returncode == 0, f"ckptctl restore failed ({out.returncode}): {out.stderr}"
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _restart(daemon: Daemon) -> Daemon:
    """SIGTERM (exit 0 asserted), then a daemon on the same socket, store and state."""
    assert daemon.stop() == 0, f"ckptd did not exit 0 on SIGTERM:\n{daemon.log()[-3000:]}"
    return Daemon(daemon.root)


def test_a_restore_lands_in_the_callers_cgroup_and_outlives_a_daemon_restart(
    start_daemon: Any, procs: Procs, make_cgroup: Callable[[str], str], mount: Path
) -> None:
    """The job ran in a cgroup that is gone when it is restored (a Slurm step, an old pod):
    CRIU must not make it again; the tree goes where the restore was asked from."""
    d: Daemon = start_daemon()
    old, caller_cgroup = make_cgroup("job"), make_cgroup("caller")
    assert caller_cgroup != cgroup_of(d.pid)
    job = Job(procs, d, old)
    _rmdir(mount / old.lstrip("/"))

    res = _restore_from(d, caller_cgroup, job.ck["id"])
    root = procs.add(res["pid"])
    tree = [root, *descendants(root)]
    for pid in tree[1:]:
        procs.add(pid)
    assert len(tree) == 3, f"the restored tree: {tree}"
    assert {p: cgroup_of(p) for p in tree} == dict.fromkeys(tree, caller_cgroup)
    assert not (mount / old.lstrip("/")).exists(), "the job's old cgroup was made again"
    output = Path(res["output_path"])
    before = len(wait_for_lines(output, 1))

    d2 = _restart(d)
    try:
        for pid in tree:
            assert_running(pid, "(restored, after the daemon restarted)")
            assert cgroup_of(pid) == caller_cgroup
        wait_for_lines(output, before + 3, timeout=10)  # still making progress
        assert_continuity(job.pre, wait_for_done(output, timeout=60), job.ref)
    finally:
        assert d2.stop() == 0, d2.log()[-3000:]


def test_a_restore_asked_from_the_daemons_cgroup_gets_a_cgroup_of_its_own(
    start_daemon: Any, procs: Procs, mount: Path
) -> None:
    d: Daemon = start_daemon()
    job = Job(procs, d)
    assert cgroup_of(os.getpid()) == cgroup_of(d.pid), "the test asks from the daemon's"

    res = _restore_from(d, None, job.ck["id"])
    root = procs.add(res["pid"])
    tree = [root, *descendants(root)]
    own = cgroup_of(root)
    assert own.startswith(f"{d.jobs_cgroup}/{job.ck['id']}-r"), own
    assert {p: cgroup_of(p) for p in tree} == dict.fromkeys(tree, own)
    output = Path(res["output_path"])

    d2 = _restart(d)  # its start-up sweep spares the populated cgroup
    try:
        assert (mount / own.lstrip("/")).is_dir()
        assert_continuity(job.pre, wait_for_done(output, timeout=60), job.ref)
    finally:
        assert d2.stop() == 0, d2.log()[-3000:]
    # the job has ended: the next start-up removes its empty cgroup
    wait_until(lambda: not any(is_alive(p) for p in tree), 10, "the ended job to exit")
    d3 = Daemon(d.root)
    try:
        assert not (mount / own.lstrip("/")).exists()
    finally:
        assert d3.stop() == 0, d3.log()[-3000:]
