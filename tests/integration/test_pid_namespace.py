"""Jobs that are the init of their own pid namespace (what ``unshare --fork --pid``, runc, crun
and podman make), with decoys: processes placed at the node pids equal to the job's pids
inside its namespace (``/proc/sys/kernel/ns_last_pid`` before forking them). CRIU's images
name the job's processes by those inner pids; a daemon that took them for node pids would
signal the decoys. Every path that signals — dump and kill, failed dump, daemon SIGKILLed
mid-dump then recovery, group abort, drain — must leave the decoys untouched (alive, never
stopped, no signal received), and the job must continue bit for bit."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd.client import Daemon as Client

from .support import (
    Daemon,
    Procs,
    assert_held,
    assert_ok,
    assert_one_line_error,
    assert_running,
    children,
    is_alive,
    proc_state,
    start_time,
    wait_until,
)

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
NSJOB = HERE / "nsjob.py"
PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
KIDS = 2
STEPS = 150
PERIOD_S = 0.03

DECOY = r"""
import signal, sys, time
log = open(sys.argv[1], "a")
def note(signo, _frame):
    log.write(f"{signo}\n"); log.flush()
for s in signal.valid_signals():
    if s not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(s, note)
        except (OSError, ValueError):
            pass
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@dataclass
class Decoys:
    """Processes at node pids ``first``, ``first + 1``, ...; each logs every signal it gets."""

    procs: list[subprocess.Popen[str]]
    logs: list[Path]
    starts: list[int | None]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def place(cls, procs: Procs, tmp: Path, count: int = KIDS) -> Decoys:
        for attempt in range(50):  # anything forking on the node meanwhile takes a pid: retry
            first = int(NS_LAST_PID.read_text()) + 300
            if first + count >= PID_MAX:  # near the top the kernel wraps: start low
                first = 1000 + attempt * 100
            if any(proc_state(p) is not None for p in range(first, first + count)):
                continue
            made, logs = [], []
            for k in range(count):
                log = tmp / f"decoy{attempt}-{k}.signals"
                log.write_text("")
                NS_LAST_PID.write_text(str(first + k - 1))
                made.append(procs.popen([sys.executable, "-c", DECOY, str(log)],
                                        stdout=subprocess.PIPE, text=True))
                logs.append(log)
            for proc in made:
                assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            if [p.pid for p in made] == list(range(first, first + count)):
                return cls(made, logs, [start_time(p.pid) for p in made])
            for proc in made:
                proc.kill()
                proc.wait()
        raise AssertionError("could not place decoys at consecutive pids")

    def assert_untouched(self, when: str) -> None:
        for proc, log, started in zip(self.procs, self.logs, self.starts, strict=True):
            assert_running(proc.pid, f"(a decoy) {when}")
            assert start_time(proc.pid) == started, f"decoy {proc.pid} replaced {when}"
            assert log.read_text() == "", f"decoy {proc.pid} got signals {when}: {log.read_text()}"


@dataclass
class NsJob:
    """``unshare --fork --pid setsid python nsjob.py``: ``init`` is the job's root (pid 1
    inside), ``kids`` its children (node pids), whose inner pids are the decoys' pids."""

    init: int
    kids: list[int]
    out: Path

    @classmethod
    def start(cls, procs: Procs, out: Path, first: int, steps: int = STEPS,
              **popen: object) -> NsJob:
        out.mkdir()
        kwargs: dict[str, object] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL,
                                     "stderr": subprocess.DEVNULL, **popen}
        argv = ["unshare", "--fork", "--pid", "setsid", sys.executable, NSJOB, first, KIDS,
                steps, PERIOD_S, out]
        unshare = procs.popen([str(a) for a in argv], **kwargs)
        wait_until(lambda: len(children(unshare.pid)) == 1, 10, "the namespace's init")
        (init,) = children(unshare.pid)
        procs.add(init)
        wait_until(lambda: all(_lines(out / f"{n}.out") >= 3 for n in _names()), 15,
                   "every process of the job to write")
        kids = children(init)
        assert len(kids) == KIDS
        for kid in kids:
            procs.add(kid)
        return cls(init, kids, out)

    @staticmethod
    def reference(out: Path, first: int, steps: int = STEPS) -> dict[str, str]:
        """The files of an uninterrupted run (no pause between steps)."""
        out.mkdir()
        subprocess.run(["unshare", "--fork", "--pid", "setsid", sys.executable, str(NSJOB),
                        str(first), str(KIDS), str(steps), "0", str(out)],
                       check=True, timeout=60, stdin=subprocess.DEVNULL, start_new_session=True)
        return _files(out)

    def wait_done(self, timeout: float = 30.0) -> dict[str, str]:
        wait_until((self.out / "done").exists, timeout, "the job to finish")
        return _files(self.out)

    def all_gone(self) -> bool:
        return not any(is_alive(p) for p in (self.init, *self.kids))

    def assert_runs(self, when: str) -> None:
        for pid in (self.init, *self.kids):
            assert_running(pid, f"(the job) {when}")
        before = _lines(self.out / "init.out")
        wait_until(lambda: _lines(self.out / "init.out") > before, 10, f"the job to go on {when}")


def _names() -> list[str]:
    return ["init", *(f"child{k}" for k in range(KIDS))]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _files(out: Path) -> dict[str, str]:
    return {n: (out / f"{n}.out").read_text() for n in _names()}


@pytest.fixture
def decoys(procs: Procs, tmp_path: Path) -> Decoys:
    return Decoys.place(procs, tmp_path)


def test_dump_kills_the_job_restore_brings_it_back_in_a_new_namespace_bit_for_bit(
    daemon: Daemon, procs: Procs, decoys: Decoys, tmp_path: Path
) -> None:
    first = decoys.pids[0]
    ref = NsJob.reference(tmp_path / "ref", first)
    job = NsJob.start(procs, tmp_path / "out", first)
    ck = assert_ok(daemon.ctl("dump", job.init, "--name", "nsjob"), "dump")
    wait_until(job.all_gone, 10, "the dumped job to be killed, every process of it")
    decoys.assert_untouched("after the dump")

    shown = assert_ok(daemon.ctl("show", ck["id"]), "show")
    assert [p["pid"] for p in shown["processes"]] == [job.init, *job.kids], "node pids"
    assert [p["ns_pid"] for p in shown["processes"]] == [1, *decoys.pids], "inner pids"

    res = assert_ok(daemon.ctl("restore", "--name", "nsjob"), "restore")
    root = procs.add(res["pid"])
    assert Path(f"/proc/{root}/status").read_text().count("NSpid:") == 1
    assert f"NSpid:\t{root}\t1" in Path(f"/proc/{root}/status").read_text(), "init of a new ns"
    for kid in children(root):
        procs.add(kid)
    assert job.wait_done() == ref
    decoys.assert_untouched("after the restore")


def test_a_failed_dump_leaves_job_and_decoys_running(
    daemon: Daemon, procs: Procs, decoys: Decoys, tmp_path: Path
) -> None:
    """The job's stdout is a Unix socket whose peer is outside its tree: CRIU refuses it after
    freezing the tree, which must run again, whole."""
    import socket

    outside, inside = socket.socketpair()
    try:
        job = NsJob.start(procs, tmp_path / "out", decoys.pids[0], steps=100_000,
                          stdout=inside.fileno())
        inside.close()
        res = daemon.ctl("dump", job.init)
        assert_one_line_error(res, res.rc, "CRIU dump of pid")
        job.assert_runs("after a failed dump")
        decoys.assert_untouched("after a failed dump")
        assert daemon.checkpoints_of(job.init) == []
    finally:
        outside.close()


def test_group_abort_and_a_daemon_killed_mid_dump_resume_the_job_and_spare_the_decoys(
    start_daemon: Callable[..., Daemon], procs: Procs, decoys: Decoys, tmp_path: Path
) -> None:
    """A group member is dumped and held (frozen, nothing committed): aborting the group
    resumes it; held again, the daemon SIGKILLed: the next daemon's recovery (from the
    journal) resumes it. Both paths signal the tree — only the tree."""
    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb

    from .conftest import criu_path

    job = NsJob.start(procs, tmp_path / "out", decoys.pids[0], steps=100_000)
    d = Daemon(tmp_path / "killed", "--criu", str(criu_path()))  # not the fixture's: killed
    try:
        with Client(str(d.socket)) as client:
            client.stub.GroupPrepare(pb.GroupPrepareRequest(group_id="g-abort", pid=job.init,
                                                            timeout_s=300), timeout=60)
            assert_held(job.init)
            client.stub.GroupAbort(pb.GroupAbortRequest(group_id="g-abort"), timeout=60)
        job.assert_runs("after the group abort")
        decoys.assert_untouched("after the group abort")

        with Client(str(d.socket)) as client:
            client.stub.GroupPrepare(pb.GroupPrepareRequest(group_id="g-kill", pid=job.init,
                                                            timeout_s=300), timeout=60)
        assert_held(job.init, *job.kids)
    finally:
        d.proc.kill()
        d.proc.wait()
    again = start_daemon("--store", str(d.store), "--state-dir", str(d.state_dir))
    job.assert_runs("after the restarted daemon's recovery")
    decoys.assert_untouched("after recovery")
    assert assert_ok(again.ctl("list"), "list") == []


def test_drain_and_resume_of_a_pid_namespace_job(
    daemon: Daemon, procs: Procs, decoys: Decoys, tmp_path: Path
) -> None:
    first = decoys.pids[0]
    ref = NsJob.reference(tmp_path / "ref", first)
    job = NsJob.start(procs, tmp_path / "out", first)
    assert_ok(daemon.ctl("policy", "set", job.init, "--name", "nsdrain", "--on-term"), "set")
    drained = assert_ok(daemon.ctl("drain"), "drain")
    assert [p["name"] for p in drained["drained"]] == ["nsdrain"], drained
    wait_until(job.all_gone, 10, "the drained job to be killed")
    decoys.assert_untouched("after the drain")
    time.sleep(0.2)
    res = assert_ok(daemon.ctl("resume", "nsdrain"), "resume")
    root = procs.add(res["restored"][0]["pid"])
    for kid in children(root):
        procs.add(kid)
    assert job.wait_done() == ref
    decoys.assert_untouched("after the resume")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--mount-proc"], "a mount namespace of its own"),
     (["--net"], "a network namespace of its own")],
    ids=["mount-ns", "net-ns"],
)
def test_what_cannot_be_restored_yet_is_refused_before_anything_is_frozen(
    daemon: Daemon, procs: Procs, flags: list[str], needle: str
) -> None:
    unshare = procs.popen(["unshare", "--fork", "--pid", *flags, "setsid", "sh", "-c",
                           "sleep 600 & exec sleep 600"], stdin=subprocess.DEVNULL)
    wait_until(lambda: len(children(unshare.pid)) == 1, 10, "the namespace's init")
    (init,) = children(unshare.pid)
    procs.add(init)
    res = daemon.ctl("dump", init)
    assert_one_line_error(res, 2, needle, "issue #12", "unshare --fork --pid")
    assert_running(init, "after a refused dump")
    assert proc_state(init) not in ("T", "t")


def test_a_process_inside_a_namespace_and_a_nested_namespace_are_refused_naming_the_init(
    daemon: Daemon, procs: Procs, decoys: Decoys, tmp_path: Path
) -> None:
    job = NsJob.start(procs, tmp_path / "out", decoys.pids[0], steps=100_000)
    res = daemon.ctl("dump", job.kids[0])
    assert_one_line_error(res, 2, f"is pid {decoys.pids[0]} inside a pid namespace",
                          "namespace's init")
    (unshare,) = [p for p in procs_parents(job.init)]
    res = daemon.ctl("dump", unshare)
    assert_one_line_error(res, 2, f"process {job.init}", "nested")
    job.assert_runs("after refused dumps")
    decoys.assert_untouched("after refused dumps")


def procs_parents(pid: int) -> list[int]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return [int(raw[raw.rindex(")") + 2 :].split()[1])]
