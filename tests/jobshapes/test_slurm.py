"""deploy/slurm/train.sbatch end to end, under a stand-in for Slurm (tests/jobshapes/slurm:
``sbatch`` and ``scontrol``; issue 11, point 5), with deploy/slurm/prolog.sh and epilog.sh as
the node's Prolog and Epilog.

The batch script runs the DataLoader training through ``ckptctl run``; ``--signal=B:TERM@N``
lands mid-run; the script has the daemon checkpoint the job and requeues it (``scontrol
requeue``); the stand-in runs the script again, which restores the latest checkpoint and waits
for the job to end. The job's lines in ``train-<id>.out`` (shared, as in Slurm, with the batch
script's own log lines), its train.log and state.bin are an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.support import REPO, VENV_BIN, Daemon, Procs
from tests.jobshapes.shapes import (
    DATALOADER,
    JOB_FILES,
    Outcome,
    References,
    assert_same_bytes,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

STANDIN = Path(__file__).resolve().parent / "slurm"
SLURM_DEPLOY = REPO / "deploy" / "slurm"
STEPS = 40
PACE = 0.3
# The signal lands SIGNAL_AT s into each run: after the first run's start-up (~3 s) and before
# its end (~3 s + STEPS x PACE = 15 s); the second run — restore (~3 s) and the steps left —
# then ends before its own signal. Under load a run may be signalled again: the job is then
# checkpointed and requeued once more, which must work as well.
TIME_LIMIT_S = 40
SIGNAL_AT = 11

TRAIN_PY = """\
# The job's training script (what train.sbatch runs as `python train.py`): the DataLoader
# workload of the job-shape tier, exec'd (the same process).
import os
import sys

os.execv(sys.executable, [sys.executable, {workload!r}, "--out-dir", {out_dir!r},
                          "--steps", "{steps}", "--pace", "{pace}"])
"""



def from_the_script(line: bytes) -> bool:
    """A line of train.sbatch's ``log`` (``<date> train.sbatch[NAME]: ...``) or a message
    of ckptctl (``ckptctl: ...``), not of the job."""
    return b" train.sbatch[" in line or line.startswith(b"ckptctl: ")


def test_train_sbatch_checkpointed_at_the_signal_requeued_and_restored(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path
) -> None:
    want = references.get("dataloader", STEPS)
    submit, state = tmp_path / "submit", tmp_path / "slurm-state"
    submit.mkdir()
    out_dir = submit / "out"
    (submit / "train.py").write_text(TRAIN_PY.format(
        workload=str(DATALOADER), out_dir=str(out_dir), steps=STEPS, pace=PACE))
    env = {
        **os.environ,
        "PATH": f"{STANDIN}:{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "CKPTD_SOCKET": str(daemon.socket),
        "SLURM_STANDIN_DIR": str(state),
        "SLURM_STANDIN_PROLOG": str(SLURM_DEPLOY / "prolog.sh"),
        "SLURM_STANDIN_EPILOG": str(SLURM_DEPLOY / "epilog.sh"),
        "SLURM_STANDIN_MAX_REQUEUES": "4",
    }
    sbatch = procs.popen(
        [str(STANDIN / "sbatch"), f"--time=0:{TIME_LIMIT_S}",
         f"--signal=B:TERM@{TIME_LIMIT_S - SIGNAL_AT}", str(SLURM_DEPLOY / "train.sbatch")],
        cwd=submit, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    out, err = sbatch.communicate(timeout=150)
    job = out.split()[-1]
    events = (state / "events").read_text()
    job_out = submit / f"train-{job}.out"
    output = job_out.read_bytes() if job_out.exists() else b""
    what = (f"\nsbatch stderr: {err}\nevents:\n{events}\n"
            f"{job_out.name}:\n{output.decode(errors='replace')}")
    assert out.startswith("Submitted batch job "), what
    assert sbatch.returncode == 0, f"the job's last run exited {sbatch.returncode}{what}"
    assert "scontrol requeue" in events and "requeued (restart 1)" in events, \
        f"never requeued{what}"
    assert "prolog exited 0" in events, what

    job_lines = b"".join(line for line in output.splitlines(keepends=True)
                         if not from_the_script(line))
    assert_same_bytes(job_lines, want.stdout, f"the job's lines in {job_out.name}")
    got = Outcome.read(job_out, out_dir)
    for name in JOB_FILES:
        assert_same_bytes(got.files[name], want.files[name], name)

    # The batch script's own lines: in train-<id>.out, or beside it where a restore put the
    # job's output back as it was at the checkpoint (what was on disk kept aside).
    script_text = b"".join(p.read_bytes() for p in submit.iterdir()
                           if p.name.startswith(job_out.name))
    for needle in (b"starting", b"SIGTERM: checkpointing", b"requeueing (restart 1)",
                   b"restoring ck-", b"restored as pid", b"ended"):
        assert needle in script_text, f"no {needle!r} line from train.sbatch{what}"
    print(f"[jobshapes] slurm stand-in events:\n{events}")
