"""deploy/slurm as shipped on a real Slurm cluster (``cluster.py``): each flow ends in a
training that finished bit for bit like an uninterrupted run (issue 26, point 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobshapes.shapes import References
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import STEPS, TrainingJob

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def test_preemption_checkpoints_within_grace_time_requeues_and_restores(
    cluster: SlurmCluster, references: References, tmp_path: Path
) -> None:
    """A job of partition high (PriorityTier 10) needs the node of the training (partition
    low, PreemptMode=REQUEUE, GraceTime): Slurm signals the job's steps — train.sbatch's
    notice step — the script has ckptd checkpoint the training, Slurm requeues the job, and
    its next run restores the checkpoint and finishes."""
    want = references.get("dataloader", STEPS)
    job = TrainingJob(cluster, tmp_path / "submit")
    job.submit_job("--time=5")
    node = job.wait_steps(5)
    cluster.sbatch("--partition=high", f"--nodelist={node}", "--exclusive",
                   "--job-name=urgent", "--wrap=sleep 2", cwd=tmp_path)
    done = cluster.wait_job(job.id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                            timeout=150)
    assert done["JobState"] == "COMPLETED", f"{done}\n{job.script_text().decode()}"
    assert int(done["Restarts"]) >= 1, done
    job.check(want, b"preempted: checkpointing", b"restoring ck-", b"restored as pid",
              b"ended")
