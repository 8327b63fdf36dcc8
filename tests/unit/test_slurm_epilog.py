"""Issue 33 (7): the Slurm Epilog (``deploy/slurm/epilog.sh``, run as shipped) checkpoints a
job's tree still running after the job only when the process at the recorded pid is the job's
own: its start time (field 22 of /proc/PID/stat) must be the one ckptd recorded with the pid
(the policy's ``started``). A pid reused by another process of the same user (its next job)
is left alone. ``ckptctl`` is a stand-in that answers as the daemon would and logs each dump;
the process is a real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EPILOG = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "epilog.sh"
JOB = "4242"

FAKE_CKPTCTL = """#!{python}
import json, os, sys
args = sys.argv[1:]
if "policy" in args and "show" in args:
    print(os.environ["FAKE_POLICIES"])
elif "list" in args:
    print(os.environ["FAKE_CHECKPOINTS"])
elif "dump" in args:
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
else:
    sys.exit(2)
"""


def start_time(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2:].split()[19])


@pytest.fixture
def other_job() -> Iterator[int]:
    """A live process of this user (what holds the job's pid now, or the job itself)."""
    proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def run_epilog(tmp_path: Path, pid: int, started: int) -> tuple[list[list[str]], str]:
    """The epilog of job ``JOB`` with ckptd's record: job ``train-JOB`` at ``pid`` started at
    ``started``; the dumps it asked for, and what it logged."""
    ckptctl = tmp_path / "ckptctl"
    ckptctl.write_text(FAKE_CKPTCTL.format(python=sys.executable))
    ckptctl.chmod(0o755)
    log = tmp_path / "dumps"
    name = f"train-{JOB}"
    env = {**os.environ, "CKPTCTL": str(ckptctl), "SLURM_JOB_ID": JOB,
           "SLURM_JOB_UID": str(os.getuid()), "FAKE_LOG": str(log),
           "FAKE_POLICIES": json.dumps([{"name": name, "pid": pid, "started": started,
                                         "uid": os.getuid()}]),
           "FAKE_CHECKPOINTS": json.dumps([{"id": "ck-20260101T000000-abcdef", "name": name,
                                            "pid": pid}])}
    proc = subprocess.run(["bash", str(EPILOG)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    dumps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return dumps, proc.stderr


def test_a_pid_reused_by_the_same_users_other_process_is_left_alone(
    tmp_path: Path, other_job: int
) -> None:
    dumps, said = run_epilog(tmp_path, other_job, start_time(other_job) - 1)
    assert dumps == [], "a process that is not the job's was checkpointed (and stopped)"
    assert f"pid {other_job} is not train-{JOB}'s process now" in said, said


def test_the_jobs_own_process_is_checkpointed(tmp_path: Path, other_job: int) -> None:
    dumps, said = run_epilog(tmp_path, other_job, start_time(other_job))
    assert len(dumps) == 1, said
    assert dumps[0][-6:] == ["dump", str(other_job), "--name", f"train-{JOB}", "--keep", "3"]


def test_an_unknown_start_time_is_never_taken_for_the_job(
    tmp_path: Path, other_job: int
) -> None:
    dumps, _ = run_epilog(tmp_path, other_job, 0)
    assert dumps == []


def test_the_daemon_answers_each_policys_start_time() -> None:
    """What the epilog compares with: ``ckptctl policy show --json`` carries ``started``."""
    from ckptd.domain.policy import Policy
    from ckptd.transport.cli.jobs import policy_to_dict
    from ckptd.transport.grpc import convert

    shown = policy_to_dict(convert.policy(Policy(name=f"train-{JOB}", pid=77, started=9876)))
    assert (shown["pid"], shown["started"]) == (77, 9876)
