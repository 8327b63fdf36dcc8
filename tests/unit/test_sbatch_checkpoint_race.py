"""deploy/slurm/train.sbatch's requeued run when its SIGTERM's checkpoint fails: a training
that ended during the checkpoint (CRIU: "could not be seized ... exited meanwhile", seen in
CI: the time limit's signal came as the training printed its last line) completes the job; a
checkpoint that fails with the training still running fails the job (exit 1, not requeued).

The script runs for real under bash; only the commands it calls at the ports (``ckptctl``,
``srun``, ``scontrol``) are stand-ins on PATH, and the "restored" training is a real process
of this test (so that, killed, it stays a zombie until the test reaps it: as the restored
tree stays one until its parent reaps it)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "train.sbatch"

CKPTCTL = """#!/bin/bash
case "$1 $2" in
  "list --name") echo '[{"id": "ck-20261202T000000-aaaaaa"}]' ;;
  "restore --name") echo "{\\"pid\\": $TRAINING}" ;;
  "policy set"|"policy clear") ;;
  "policy show") echo '[]' ;;
  dump*) [ "$DUMP" = kill ] && kill -KILL "$TRAINING"
         echo "ckptctl: CRIU dump of pid $TRAINING failed: stand-in" >&2; exit 1 ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""


def _bin(tmp_path: Path) -> Path:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("ckptctl", CKPTCTL), ("srun", "#!/bin/sh\nexit 1\n"),
                       ("scontrol", f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol\n")):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    return fake


def _run(tmp_path: Path, dump: str) -> tuple[int, str]:
    training = subprocess.Popen(["sleep", "600"])
    err = tmp_path / "err"
    try:
        env = {"PATH": f"{_bin(tmp_path)}:/usr/bin:/bin", "SLURM_JOB_NAME": "train",
               "SLURM_JOB_ID": "7", "TRAINING": str(training.pid), "DUMP": dump,
               "CKPTD_SOCKET": str(tmp_path / "none.sock")}
        with err.open("wb") as sink:
            job = subprocess.Popen(["bash", str(SCRIPT)], cwd=tmp_path, env=env,
                                   stdout=sink, stderr=sink)
        deadline = time.monotonic() + 30
        while b"restored as pid" not in err.read_bytes():
            assert job.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        time.sleep(0.3)  # into the loop that waits, its trap set
        job.send_signal(signal.SIGTERM)
        rc = job.wait(timeout=30)
        return rc, err.read_text()
    finally:
        if training.poll() is None:
            training.kill()
        training.wait()


@pytest.mark.timeout(60)
def test_a_training_that_ends_during_the_checkpoint_completes_the_job(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, dump="kill")
    assert rc == 0, out
    assert "ended during the checkpoint" in out, out
    assert not (tmp_path / "scontrol").exists(), "requeued onto an old checkpoint"


@pytest.mark.timeout(60)
def test_a_failed_checkpoint_of_a_running_training_fails_the_job(tmp_path: Path) -> None:
    rc, out = _run(tmp_path, dump="fail")
    assert rc == 1, out
    assert "stand-in" in out and "ended" not in out.split("SIGTERM", 1)[1], out
    assert not (tmp_path / "scontrol").exists()
