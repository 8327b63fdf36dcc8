"""Jobs the daemon protects, end to end with real CRIU: ``ckptctl run`` (SIGTERM checkpoints
the job, other signals pass through, the job's own exit status comes back), periodic policies
that survive a daemon restart, ``ckptctl drain`` / ``resume``, and the events of all that.
Every job that comes back is checked bit for bit against an uninterrupted run."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import (
    CKPTCTL,
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    assert_running,
    is_alive,
    read_lines_file,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 120
INTERVAL = 30


def counter() -> tuple[list[str], list[str]]:
    cmd = workload("counter", "--steps", STEPS, "--mem-mib", 8)
    return with_interval(cmd, INTERVAL), reference(with_interval(cmd, 0))


def launch(procs: Procs, daemon: Daemon, out: Path, *run_args: str, cmd: list[str]
           ) -> subprocess.Popen[bytes]:
    """``ckptctl run ... -- cmd`` with the job's stdout appended to ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return procs.popen(
            [str(CKPTCTL), "--socket", str(daemon.socket), "run", *run_args, "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.PIPE,
        )
    finally:
        os.close(fd)


def job_of(launcher: subprocess.Popen[bytes]) -> int:
    path = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    wait_until(lambda: path.read_text().split(), 10, "ckptctl run to start the job")
    return int(path.read_text().split()[0])


def policies(daemon: Daemon) -> dict[str, dict[str, Any]]:
    listed = assert_ok(daemon.ctl("policy", "show"), "policy show")
    return {p["name"]: p for p in listed}


def event_kinds(daemon: Daemon) -> list[str]:
    res = daemon.ctl("events", "--last", "200")
    assert res.rc == 0, res.err
    text = res.out if isinstance(res.out, str) else json.dumps(res.out)
    kinds = []
    for line in text.splitlines():
        if line.strip():
            kinds.append(json.loads(line)["kind"])
    return kinds


def test_run_checkpoints_the_job_on_sigterm_and_resume_brings_it_back(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd, ref = counter()
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "trainer", cmd=cmd)
    job = job_of(launcher)
    wait_for_lines(out, 5)
    assert policies(daemon)["trainer"]["on_term"] is True
    assert os.getsid(job) == job, "the job runs in a session of its own"

    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, err
    assert b"checkpointed as ck-" in err and b"ckptctl resume trainer" in err, err
    assert not is_alive(job)
    drained = policies(daemon)["trainer"]["drained_checkpoint_id"]
    assert drained.startswith("ck-")

    res = assert_ok(daemon.ctl("resume", "trainer"), "resume")
    procs.add(res["restored"][0]["pid"])
    assert res["restored"][0]["pid"] == job and res["restored"][0]["id"] == drained
    assert wait_for_done(out) == ref
    assert policies(daemon)["trainer"]["drained_checkpoint_id"] == ""
    kinds = event_kinds(daemon)
    for kind in ("policy.set", "checkpoint.started", "checkpoint.committed", "drain",
                 "restore.done", "resume"):
        assert kind in kinds, (kind, kinds)
    assert_ok(daemon.ctl("policy", "clear", "trainer"), "policy clear")


def test_run_passes_other_signals_on_and_returns_the_jobs_exit_status(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    out = tmp_path / "sh.out"
    script = ("trap 'echo got-usr1' USR1; i=0; while [ $i -lt 100 ]; do sleep 0.05; "
              "i=$((i+1)); [ -e \"$STOP\" ] && exit 7; done; exit 3")
    stop = tmp_path / "stop"
    env_cmd = ["env", f"STOP={stop}", "sh", "-c", script]
    launcher = launch(procs, daemon, out, "--name", "trapper", cmd=env_cmd)
    job_of(launcher)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGUSR1)
    wait_until(lambda: "got-usr1" in out.read_text(), 10, "the job to get SIGUSR1")
    stop.touch()
    launcher.communicate(timeout=30)
    assert launcher.returncode == 7
    assert "trapper" not in policies(daemon), "a job that ended on its own leaves no policy"


def test_a_sigterm_after_the_job_ended_returns_the_jobs_status_and_checkpoints_nothing(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """A time limit's SIGTERM can come just after the job finished, before ``ckptctl run``
    noticed (Slurm checks limits every 30 s): the job's own status comes back, not 143 (a
    batch script would requeue a finished job), with no failure line and no checkpoint. Made
    certain here by stopping ``ckptctl run`` while the job ends and the signal comes."""
    done = tmp_path / "done"
    cmd = ["sh", "-c", f'while [ ! -e "{done}" ]; do sleep 0.05; done; exit 3']
    launcher = launch(procs, daemon, tmp_path / "job.out", "--name", "finisher", cmd=cmd)
    job = job_of(launcher)
    wait_until(lambda: "finisher" in policies(daemon), 10, "the job's policy")
    launcher.send_signal(signal.SIGSTOP)
    try:
        done.touch()
        wait_until(lambda: Path(f"/proc/{job}/stat").read_text().split(") ")[1][0] == "Z",
                   10, "the job to end (a zombie: ckptctl run is stopped)")
        launcher.send_signal(signal.SIGTERM)
    finally:
        launcher.send_signal(signal.SIGCONT)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 3, err
    assert b"had ended (exit status 3) before SIGTERM: nothing to checkpoint" in err, err
    assert b"failed" not in err, err
    assert "finisher" not in policies(daemon), "a job that ended on its own leaves no policy"
    assert assert_ok(daemon.ctl("list", "--name", "finisher"), "list") == []


def test_periodic_policy_checkpoints_a_running_job_and_survives_a_restart(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    d = start_daemon()
    cmd = workload("counter", "--steps", 100_000, "--mem-mib", 8)
    out = tmp_path / "job.out"
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out)
    wait_for_lines(out, 3)
    set_res = assert_ok(d.ctl("policy", "set", pid, "--name", "periodic", "--every", "10s",
                              "--keep", "2"), "policy set")
    assert set_res["every_s"] == 10 and set_res["keep"] == 2 and set_res["pid"] == pid
    wait_until(lambda: len(assert_ok(d.ctl("list", "--name", "periodic"), "list")) >= 1, 20,
               "the first periodic checkpoint")
    assert_running(pid, "a periodic checkpoint leaves the job running")
    first = policies(d)["periodic"]["last_checkpoint_id"]

    # a restarted daemon (same state directory) keeps the policy and goes on with it
    assert d.stop() == 0
    again = start_daemon("--store", str(d.store), "--state-dir", str(d.state_dir))
    assert policies(again)["periodic"]["every_s"] == 10
    wait_until(lambda: policies(again)["periodic"]["last_checkpoint_id"] not in ("", first),
               30, "the next periodic checkpoint, by the restarted daemon")
    assert_running(pid, "still running")
    assert "policy.fired" in event_kinds(again)
    n_lines = len(read_lines_file(out))
    wait_for_lines(out, n_lines + 3)


def test_drain_stops_every_protected_job_and_resume_all_restores_them(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    jobs = []
    for name in ("one", "two"):
        cmd, ref = counter()
        out = tmp_path / f"{name}.out"
        pid = start_detached(procs, cmd, out)
        jobs.append((name, pid, out, ref))
    for name, pid, out, _ref in jobs:
        wait_for_lines(out, 3)
        assert_ok(daemon.ctl("policy", "set", pid, "--name", name, "--on-term"), "set")

    drained = assert_ok(daemon.ctl("drain"), "drain")
    assert sorted(p["name"] for p in drained["drained"]) == ["one", "two"]
    assert drained["errors"] == []
    for _name, pid, _out, _ref in jobs:
        assert not is_alive(pid)

    resumed = assert_ok(daemon.ctl("resume", "--all"), "resume --all")
    assert sorted(r["pid"] for r in resumed["restored"]) == sorted(p for _, p, _, _ in jobs)
    for r in resumed["restored"]:
        procs.add(r["pid"])
    for _name, _pid, out, ref in jobs:
        assert wait_for_done(out) == ref
    for name, *_ in jobs:
        assert_ok(daemon.ctl("policy", "clear", name), "clear")
    assert policies(daemon) == {}


def test_a_prestop_dump_by_name_drains_the_job_and_run_reports_it(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """Kubernetes runs preStop (`ckptctl dump --name N`) before it sends SIGTERM."""
    cmd, ref = counter()
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "prestopped", cmd=cmd)
    job = job_of(launcher)
    wait_for_lines(out, 5)
    res = assert_ok(daemon.ctl("dump", "--name", "prestopped"), "dump --name")
    assert res["drained"] and res["id"].startswith("ck-")
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 143 and res["id"].encode() in err, err
    again = assert_ok(daemon.ctl("dump", "--name", "prestopped"), "dump --name again")
    assert again["id"] == res["id"], "a second preStop finds it checkpointed already"
    restored = assert_ok(daemon.ctl("resume", "prestopped"), "resume")["restored"][0]
    procs.add(restored["pid"])
    assert restored["pid"] == job
    assert wait_for_done(out) == ref
    assert_ok(daemon.ctl("policy", "clear", "prestopped"), "clear")
    missing = daemon.ctl("dump", "--name", "nobody")
    assert missing.rc == 2 and "no job named 'nobody' is protected here" in missing.err


def test_drained_jobs_come_back_when_the_daemon_starts_again(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    """Maintenance: drain, stop the daemon (the node goes down), start it with
    ``resume_drained_on_start``: the job is restored by policy, with no command."""
    d = start_daemon()
    cmd, ref = counter()
    out = tmp_path / "job.out"
    pid = start_detached(procs, cmd, out)
    wait_for_lines(out, 3)
    assert_ok(d.ctl("policy", "set", pid, "--name", "nightly", "--on-term"), "set")
    assert [p["name"] for p in assert_ok(d.ctl("drain"), "drain")["drained"]] == ["nightly"]
    assert d.stop() == 0
    again = start_daemon("--store", str(d.store), "--state-dir", str(d.state_dir),
                         config={"resume_drained_on_start": True})
    wait_until(lambda: is_alive(pid), 30, "the drained job to be restored at start")
    procs.add(pid)
    assert wait_for_done(out) == ref
    assert policies(again)["nightly"]["drained_checkpoint_id"] == ""
    assert "resume" in event_kinds(again)


def test_run_never_signals_a_job_the_daemon_is_still_checkpointing(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """The drain call outlives --grace: run waits for the daemon's verdict, not a SIGTERM
    sent into the middle of the dump (it would be saved in the image)."""
    cmd, ref = counter()
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "slowgrace", "--grace", "0.001", cmd=cmd)
    job = job_of(launcher)
    wait_for_lines(out, 5)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err
    assert b"after --grace" in err, err
    restored = assert_ok(daemon.ctl("resume", "slowgrace"), "resume")["restored"][0]
    procs.add(restored["pid"])
    assert restored["pid"] == job
    assert wait_for_done(out) == ref, "no SIGTERM was saved in the image"
    assert_ok(daemon.ctl("policy", "clear", "slowgrace"), "clear")


OTHER_USER = "ckptd-t-resume"


@pytest.fixture(scope="module")
def other_user() -> Iterator[int]:
    """A real unprivileged user, created for the test (and removed after)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user")
    created = False
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                        OTHER_USER], check=True)
        created = True
    try:
        yield pwd.getpwnam(OTHER_USER).pw_uid
    finally:
        if created:
            subprocess.run(["userdel", OTHER_USER], check=False)


@pytest.fixture
def open_daemon(start_daemon: Callable[..., Daemon]) -> Iterator[Daemon]:
    """A daemon whose socket any uid may connect to (pytest's directories are root's)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-it-sock-", dir="/tmp"))
    try:
        sock_dir.chmod(0o755)
        yield start_daemon(config={"socket_mode": "666"}, socket_dir=sock_dir / "run")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_job_killed_under_run_every_is_resumed_from_its_newest_checkpoint(
    open_daemon: Daemon, procs: Procs, tmp_path: Path, other_user: int
) -> None:
    """Issue 34 (4), the check every checkpointing guide recommends: the job of ``ckptctl run
    --every`` is SIGKILLed (the job, not ``run``) once a periodic checkpoint exists. ``run``
    exits 137 saying which checkpoint exists and the command that restores it; ``ckptctl
    resume NAME`` restores exactly that one, and the job's output continues bit for bit from
    it; another user's resume of the name finds no job of theirs; a second resume while the
    restored job runs is refused in one line."""
    daemon = open_daemon
    cmd = workload("counter", "--steps", 400, "--mem-mib", 8)
    ref = reference(with_interval(cmd, 0))
    out = tmp_path / "job.out"
    launcher = launch(procs, daemon, out, "--name", "crashy", "--every", "10s",
                      cmd=with_interval(cmd, INTERVAL))
    job = job_of(launcher)
    wait_until(lambda: policies(daemon).get("crashy", {}).get("last_checkpoint_id"), 30,
               "the first periodic checkpoint")
    first = policies(daemon)["crashy"]["last_checkpoint_id"]
    assert is_alive(job), "the job outlived its first checkpoint"
    os.kill(job, signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 137, err
    assert (f"crashy (pid {job}) was killed by SIGKILL; its newest checkpoint is {first}: "
            "`ckptctl resume crashy` restores it").encode() in err, err
    assert policies(daemon)["crashy"]["last_checkpoint_id"] == first, "the policy is kept"
    theirs = daemon.ctl("resume", "crashy", user=other_user)
    assert_one_line_error(theirs, 2, "no protected job named 'crashy' here")
    assert not is_alive(job), "nothing was restored for the other user"

    res = assert_ok(daemon.ctl("resume", "crashy"), "resume")
    assert errors_of(res) == []
    restored = res["restored"][0]
    procs.add(restored["pid"])
    assert restored["id"] == first and restored["pid"] == job
    again = daemon.ctl("resume", "crashy")
    assert_one_line_error(again, 2, f"job 'crashy' still runs as pid {job}",
                          "nothing to resume")
    assert wait_for_done(out) == ref
    assert "resume" in event_kinds(daemon)
    assert_ok(daemon.ctl("policy", "clear", "crashy"), "policy clear")


def errors_of(res: dict[str, Any]) -> list[str]:
    return list(res.get("errors", []))
