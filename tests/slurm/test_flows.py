"""deploy/slurm as shipped on a real Slurm cluster (``cluster.py``): each flow ends in a
training that finished bit for bit like an uninterrupted run (issue 26, point 2).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptd.client import Daemon as Client
from ckptd.client import group_checkpoint, group_restore
from tests.integration.netns import netns_path
from tests.integration.support import VENV_PYTHON, Procs, is_alive, wait_for_done, wait_for_lines
from tests.jobshapes.shapes import DDP, Outcome, References, assert_same_outcome
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


@pytest.mark.timeout(360)
def test_time_limit_signal_before_the_limit_checkpoints_requeues_and_restores(
    cluster: SlurmCluster, references: References, tmp_path: Path
) -> None:
    """``--time=1 --signal=B:TERM@45``: SIGTERM to the batch shell 15 to 45 s into the run
    (slurmctld checks limits every 30 s), mid-training (52 s of it); train.sbatch has ckptd
    checkpoint the training and requeues the job (``scontrol requeue``); the next run restores
    it, and finishes (its own signal may checkpoint and requeue it once more first).

    A signal that comes after the training ended (a shorter training: it happened) finds
    nothing to checkpoint: the job completes once, never requeued onto an old checkpoint
    (``test_a_sigterm_after_the_job_ended...`` in tests/integration/test_jobs.py)."""
    want = references.get("dataloader", STEPS)
    job = TrainingJob(cluster, tmp_path / "submit", pace=1.3)
    job.submit_job("--time=1", "--signal=B:TERM@45")
    done = cluster.wait_job(job.id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                            timeout=300)
    assert done["JobState"] == "COMPLETED", f"{done}\n{job.script_text().decode()}"
    assert int(done["Restarts"]) >= 1, (
        f"no requeue: the time limit's signal came after the training ended\n{done}")
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


DDP_SBATCH = """\
#!/bin/bash
#SBATCH --job-name=ddp --nodes=2 --ntasks=2 --ntasks-per-node=1 --output=ddp-%j.out
# One DDP rank per node (gloo over the nodes' link), each in a session of its own (setsid:
# CRIU needs it) writing to a file of its own (a pipe to slurmstepd would not come back).
srun --kill-on-bad-exit=0 bash -c '
    case $SLURMD_NODENAME in node1) ifname={veth_a} ;; *) ifname={veth_b} ;; esac
    exec setsid -w env MASTER_ADDR={master} MASTER_PORT={port} RANK=$SLURM_PROCID \\
        WORLD_SIZE=2 USE_LIBUV=0 GLOO_SOCKET_IFNAME=$ifname {python} {ddp} --out-dir {out} \\
        --steps {steps} --pace 0.4 >rank$SLURM_PROCID.out 2>rank$SLURM_PROCID.err </dev/null'
"""
DDP_STEPS = 30
DDP_PORT = 29533


def rank_pids(cluster: SlurmCluster, out_dir: Path) -> dict[str, int]:
    """Node -> pid of the DDP rank of this test running there (by its network namespace)."""
    inodes = {os.stat(netns_path(ns)).st_ino: node for node, ns in cluster.netns.items()}
    found: dict[str, int] = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            node = inodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            continue
        if node and str(DDP).encode() in argv[:3] and str(out_dir).encode() in argv:
            found[node] = pid
    return found


def test_a_two_task_ddp_job_across_the_nodes_checkpointed_and_restored_as_a_group(
    cluster: SlurmCluster, procs: Procs, references: References, tmp_path: Path
) -> None:
    """``srun`` starts one gloo DDP rank on each node; the two ranks are checkpointed as one
    group through both nodes' ckptd (all or nothing), which stops them (the Slurm job then
    ends), and restored as a group: they reconnect and finish bit for bit."""
    want = references.get("ddp", DDP_STEPS)
    submit = tmp_path / "submit"
    submit.mkdir()
    out_dir = submit / "out"
    script = submit / "ddp.sbatch"
    script.write_text(DDP_SBATCH.format(
        veth_a=cluster.nodes.veth_a, veth_b=cluster.nodes.veth_b,
        master=cluster.nodes.a.address, port=DDP_PORT, python=VENV_PYTHON, ddp=DDP,
        out=out_dir, steps=DDP_STEPS))
    job = cluster.sbatch(str(script), cwd=submit)
    wait_for_lines(submit / "rank0.out", 5, timeout=90)
    ranks = rank_pids(cluster, out_dir)
    assert sorted(ranks) == list(NODES), f"ranks found: {ranks}; {cluster.job(job)}"

    with Client(str(cluster.daemons["node1"].socket)) as c1, \
            Client(str(cluster.daemons["node2"].socket)) as c2:
        group = group_checkpoint([(c1, ranks["node1"]), (c2, ranks["node2"])],
                                 name=f"ddp-{job}")
        assert not any(is_alive(pid) for pid in ranks.values()), "both ranks are stopped"
        ended = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
        restored = group_restore(group, [c1, c2])
    for pid in restored.values():
        procs.add(pid)
    assert sorted(restored.values()) == sorted(ranks.values())
    wait_for_done(submit / "rank0.out", timeout=120)
    assert_same_outcome(Outcome.read(submit / "rank0.out", out_dir), want,
                        f"DDP group of Slurm job {job} ({ended['JobState']} once stopped)")
    assert (submit / "rank1.out").read_bytes() == b"", "rank 1 prints nothing"
