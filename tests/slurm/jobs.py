"""The training job the slurm tier submits, and how its outcome is checked.

``TrainingJob`` is a submit directory holding ``train.py`` (what deploy/slurm/train.sbatch
runs as ``python train.py``: the job-shape tier's DataLoader workload, exec'd, 2 forked
workers) and, after the job, its ``%x-%j.out`` and ``out/`` (train.log, state.bin). ``check``
holds the job's lines of the output and its files against an uninterrupted run, bit for bit;
the batch script's own lines are looked for in the output or beside it, where a restore put
the output back as it was at the checkpoint (what was on disk kept aside).
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.jobshapes.shapes import DATALOADER, JOB_FILES, Outcome, assert_same_bytes
from tests.slurm.cluster import SLURM_DEPLOY, SlurmCluster

TRAIN_SBATCH = SLURM_DEPLOY / "train.sbatch"
STEPS = 40
PACE = 0.3
"""40 steps of 0.3 s: ~15 s of training after ~3 s of start-up."""

TRAIN_PY = """\
# The job's training script (what train.sbatch runs as `python train.py`): the DataLoader
# workload of the job-shape tier, exec'd (the same process).
import os
import sys

os.execv(sys.executable, [sys.executable, {workload!r}, "--out-dir", {out_dir!r},
                          "--steps", "{steps}", "--pace", "{pace}"])
"""


def from_the_script(line: bytes) -> bool:
    """A line of train.sbatch's ``log`` (``<date> train.sbatch[NAME]: ...``), of ckptctl
    (``ckptctl: ...``) or of Slurm's srun/slurmstepd, not of the job."""
    return (b" train.sbatch[" in line or line.startswith((b"ckptctl: ", b"srun: ",
                                                          b"slurmstepd")))


class TrainingJob:
    def __init__(self, cluster: SlurmCluster, submit: Path, steps: int = STEPS,
                 pace: float = PACE) -> None:
        self.cluster, self.submit, self.steps = cluster, submit, steps
        self.out_dir = submit / "out"
        submit.mkdir(parents=True, exist_ok=True)
        (submit / "train.py").write_text(TRAIN_PY.format(
            workload=str(DATALOADER), out_dir=str(self.out_dir), steps=steps, pace=pace))
        self.id = 0

    def submit_job(self, *sbatch_args: str) -> int:
        """``sbatch --gres=none ARGS deploy/slurm/train.sbatch`` from the submit directory
        (--gres=none: the template asks for a GPU; these nodes have none)."""
        self.id = self.cluster.sbatch("--gres=none", *sbatch_args, str(TRAIN_SBATCH),
                                      cwd=self.submit)
        return self.id

    @property
    def output(self) -> Path:
        return self.submit / f"train-{self.id}.out"

    def output_bytes(self) -> bytes:
        return self.output.read_bytes() if self.output.exists() else b""

    def steps_done(self) -> int:
        return sum(1 for line in self.output_bytes().splitlines() if line.startswith(b"step "))

    def wait_steps(self, n: int, timeout: float = 60) -> str:
        """Until the job has printed ``n`` steps; the node it runs on."""
        deadline = time.monotonic() + timeout
        while self.steps_done() < n:
            assert time.monotonic() < deadline, (
                f"job {self.id}: {self.steps_done()} steps in {timeout:g}s, expected {n}; "
                f"{self.cluster.job(self.id)}\n{self.script_text().decode(errors='replace')}")
            time.sleep(0.2)
        return self.cluster.job(self.id)["NodeList"]

    def script_text(self) -> bytes:
        """The output and what restores kept aside of it."""
        return b"".join(p.read_bytes() for p in sorted(self.submit.iterdir())
                        if p.name.startswith(self.output.name))

    def check(self, want: Outcome, *script_lines: bytes) -> None:
        """Bit for bit against ``want``; each of ``script_lines`` in the script's lines."""
        output = self.output_bytes()
        job_lines = b"".join(line for line in output.splitlines(keepends=True)
                             if not from_the_script(line))
        what = f"\n{self.output.name}:\n{output.decode(errors='replace')}"
        assert_same_bytes(job_lines, want.stdout, f"the job's lines in {self.output.name}"
                          + what)
        got = Outcome.read(self.output, self.out_dir)
        for name in JOB_FILES:
            assert_same_bytes(got.files[name], want.files[name], name)
        text = self.script_text()
        for needle in script_lines:
            assert needle in text, f"no {needle!r} line from train.sbatch{what}"
