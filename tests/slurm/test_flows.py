"""deploy/slurm as shipped on a real Slurm cluster (``cluster.py``): each flow ends in a
training that finished bit for bit like an uninterrupted run (issue 26, point 2).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.jobshapes.shapes import References
from tests.slurm.cluster import NODES, SlurmCluster
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


def test_time_limit_signal_before_the_limit_checkpoints_requeues_and_restores(
    cluster: SlurmCluster, references: References, tmp_path: Path
) -> None:
    """``--time=1 --signal=B:TERM@45``: SIGTERM to the batch shell some 15 s into the run
    (Slurm checks limits periodically: it may come earlier), mid-training; train.sbatch has
    ckptd checkpoint the training and requeues the job (``scontrol requeue``); the next run
    restores it and finishes before its own signal."""
    want = references.get("dataloader", STEPS)
    job = TrainingJob(cluster, tmp_path / "submit", pace=0.6)
    job.submit_job("--time=1", "--signal=B:TERM@45")
    done = cluster.wait_job(job.id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                            timeout=200)
    assert done["JobState"] == "COMPLETED", f"{done}\n{job.script_text().decode()}"
    assert int(done["Restarts"]) >= 1, done
    job.check(want, b"SIGTERM: checkpointing", b"requeueing (restart 1)", b"restoring ck-",
              b"restored as pid", b"ended")


def test_node_failure_requeues_onto_the_other_node_restored_from_the_shared_store(
    cluster: SlurmCluster, references: References, tmp_path: Path
) -> None:
    """With periodic checkpoints (``CKPTD_EVERY=10s``: train.sbatch's ``ckptctl run
    --every``), the training's node fails (its slurmd, the job's steps and its ckptd
    SIGKILLed): Slurm marks the node DOWN after SlurmdTimeout and requeues the job onto the
    other node, whose ckptd restores the latest periodic checkpoint from the shared store."""
    want = references.get("dataloader", STEPS)
    job = TrainingJob(cluster, tmp_path / "submit", pace=0.6)
    job.submit_job("--time=5", "--export=ALL,CKPTD_EVERY=10s")
    node = job.wait_steps(3)
    other = next(n for n in NODES if n != node)
    daemon = cluster.daemons[node]
    # The policy's first checkpoint is taken at once, before the job has opened its files (a
    # restore of it would append to them again): wait for the second, 10 s later.
    deadline = time.monotonic() + 40
    while len(daemon.ctl("list", "--name", f"train-{job.id}").out or []) < 2:
        assert time.monotonic() < deadline, f"no 2 periodic checkpoints in 40s\n{daemon.log()}"
        time.sleep(0.5)
    cluster.fail_node(node)
    cluster.wait_nodes("down", [node], timeout=60)
    done = cluster.wait_job(job.id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                            timeout=150)
    assert done["JobState"] == "COMPLETED", f"{done}\n{job.script_text().decode()}"
    assert done["NodeList"] == other, done
    job.check(want, b"restoring ck-", b"restored as pid", b"ended")


def test_maintenance_drain_in_slurm_and_ckptd_resumes_the_job_on_the_other_node(
    cluster: SlurmCluster, references: References, tmp_path: Path
) -> None:
    """Maintenance of the training's node: ``scontrol update nodename=N state=drain`` (no new
    job there), then ``ckptctl drain`` on N, which checkpoints and stops every protected job;
    train.sbatch sees its training stopped by ckptd (``ckptctl run`` exits 143), requeues the
    job, and Slurm starts it on the other node, where it is restored and finishes."""
    want = references.get("dataloader", STEPS)
    job = TrainingJob(cluster, tmp_path / "submit", pace=0.5)
    job.submit_job("--time=5")
    node = job.wait_steps(5)
    other = next(n for n in NODES if n != node)
    cluster.run(["scontrol", "update", f"nodename={node}", "state=drain",
                 "reason=maintenance"])
    drained = cluster.daemons[node].ctl("drain")
    assert drained.rc == 0 and [p["name"] for p in drained.out["drained"]] == \
        [f"train-{job.id}"], drained
    done = cluster.wait_job(job.id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                            timeout=150)
    assert done["JobState"] == "COMPLETED", f"{done}\n{job.script_text().decode()}"
    assert done["NodeList"] == other, done
    assert cluster.node_states()[node] == "drained", cluster.node_states()
    job.check(want, b"checkpointed and stopped by ckptd (drain)", b"restoring ck-",
              b"restored as pid", b"ended")
