"""The job shapes of issue 11 (point 6), each checkpointed, interrupted and restored through the
real daemon and CLI, and compared bit for bit — stdout, train.log, state.bin — with an
uninterrupted run:

(a) torchrun DDP (2 ranks, gloo) launched through ``ckptctl run``, checkpointed by name
    (``ckptctl dump --name``, as a preStop hook does) and restored by name, also ``--lazy``;
(b) a training loop fed by a DataLoader with 2 worker processes, also restored ``--lazy``;
(c) the node failure: a leave-running checkpoint, the job writes on, ``kill -9``, restore —
    the files end as an uninterrupted run's, and the versions found on disk are kept aside;
(d) just in time: ``ckptctl run --name J -- prog > job.log 2>&1``, SIGTERM to the launcher
    (whose own line then lands in job.log), ``ckptctl restore --name J``;
(e) the two DDP ranks on two nodes (network namespaces, a daemon each): a group checkpoint,
    both killed, a group restore, the loss curve going on bit for bit;
(f) the DataLoader loop with 6 MB batches and (g) an 8 MiB tensor shared with a process
    started by torch.multiprocessing's spawn: torch's shared memory is unlinked /dev/shm
    files, dumped by CRIU as ghost files, over CRIU's own 1 MiB limit (issue 24);
(h) a loop fed through multiprocessing spawn-context Queues (named POSIX semaphores mapped
    through an unlinked name), dumped, and checkpointed leave-running then killed (issue 34);
(i) the DataLoader loop's train.log also held open for appending by a process outside the
    tree: a leave-running checkpoint, both write on, ``kill -9``, restore — with the default
    ``shared_files = "keep"`` the log is left as found (every line of the other writer kept,
    the job's steps from the checkpoint appended after them), its other files bit for bit,
    and the dump, ``show``, ``check-restore`` and the restore name the other writer's pid;
(j) ``ckptctl run --name J --every 10s``, the job SIGKILLed (not ``run``) after a periodic
    checkpoint: ``run`` exits 137 naming it and ``ckptctl resume J``, which brings the job
    back bit for bit (its process group killed at once, or the loop alone: its workers then
    remove their ``/tmp/pymp-*`` directories, which the restore makes again for CRIU);
(k) the DataLoader loop also logging each step to ``metrics.csv`` with the ``csv`` module,
    opened, appended to and closed each step (MLflow's file store, a per-step CSV logger):
    ``ckptctl run --name J --every 10s --files OUT_DIR``, its process group SIGKILLed some
    steps after a periodic checkpoint holding the CSV, ``ckptctl resume J`` — the CSV, which
    the job held no descriptor of, rolled back too: no step logged twice, every file bit for
    bit.

What makes each pass: the files the job writes captured and put back (c, d, j), every file
of an output directory named with ``--files``, open or not, captured and put back (k), established
TCP connections inside the tree (a, e), no io_uring in jobs launched by ``ckptctl run`` (a, j),
a ghost-file limit sized for torch's shared memory (``ghost_limit``: f, g), files written
by a live process outside the tree left as they are (``shared_files``: i), the policy kept
for ``resume`` when its job dies and a bound unix socket's missing directory made again (j).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import Daemon as Client
from ckptd.client import group_checkpoint, group_restore
from tests.integration.netns import TwoNodes, in_netns
from tests.integration.support import (
    CKPTCTL,
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    descendants,
    is_alive,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
)
from tests.jobshapes.shapes import (
    JOB_FILES,
    LOG_NAME,
    METRICS_NAME,
    STATE_NAME,
    Outcome,
    OutsideWriter,
    References,
    assert_kept_aside,
    assert_same_bytes,
    assert_same_outcome,
    big_batches_cmd,
    child_of,
    dataloader_cmd,
    kill_tree,
    metrics_csv_cmd,
    rank_cmd,
    shared_spawn_cmd,
    spawn_queue_cmd,
    torchrun_cmd,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]

DDP_STEPS = 30
DL_STEPS = 40
SHM_STEPS = 20
STORE_PORT = 29517  # rank 0's TCPStore in the two-node case (namespaces of the test's own)
START_S = 60.0  # torch imports, workers, rendezvous: slow on a loaded 2-core machine

def timing(what: str, result: dict[str, Any]) -> None:
    """Printed (pytest -s shows it): how long the daemon took."""
    frozen = result.get("frozen_s")
    extra = f" (frozen {frozen:.2f}s)" if frozen is not None else ""
    print(f"[jobshapes] {what}: {result.get('duration_s', float('nan')):.2f}s{extra}")


def launch_run(procs: Procs, daemon: Daemon, name: str, cmd: list[str], stdout: Path,
               stderr: Path) -> subprocess.Popen[bytes]:
    """``ckptctl run --name NAME -- CMD`` with stdout and stderr appended to files."""
    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        return procs.popen(
            [str(CKPTCTL), "--socket", str(daemon.socket), "run", "--name", name, "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "steps"), [("dataloader", DL_STEPS), ("ddp", DDP_STEPS),
                                             ("big-batches", SHM_STEPS),
                                             ("shared-spawn", SHM_STEPS),
                                             ("metrics-csv", DL_STEPS)])
def test_the_workloads_are_deterministic(references: References, kind: str, steps: int
                                         ) -> None:
    """Two uninterrupted runs print and write the same bytes (what every test relies on)."""
    assert_same_outcome(references.run(kind, steps), references.get(kind, steps),
                        f"a second uninterrupted {kind} run")


@pytest.mark.slow
def test_the_metrics_csv_option_changes_no_other_output(references: References) -> None:
    """``--metrics-csv`` (k) adds metrics.csv, one row a step, and nothing else: stdout,
    train.log and state.bin are the DataLoader loop's bytes without it."""
    plain, with_csv = references.get("dataloader", DL_STEPS), references.get("metrics-csv",
                                                                              DL_STEPS)
    assert len(with_csv.files[METRICS_NAME].splitlines()) == DL_STEPS
    assert_same_outcome(Outcome(with_csv.stdout, {n: with_csv.files[n] for n in JOB_FILES}),
                        plain, "the DataLoader loop with --metrics-csv")


@pytest.mark.parametrize("lazy", [False, True], ids=["restore", "restore-lazy"])
def test_a_torchrun_ddp_under_ckptctl_run_dumped_and_restored_by_name(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path, lazy: bool
) -> None:
    """With ``lazy``: ``ckptctl restore --name --lazy``: the agent, both ranks and their
    loopback TCP mesh running before their memory is back."""
    want = references.get("ddp", DDP_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    launcher = launch_run(procs, daemon, "ddp-a", torchrun_cmd(out_dir, DDP_STEPS), stdout,
                          tmp_path / "stderr")
    agent = child_of(launcher.pid)
    wait_for_lines(stdout, 5, timeout=START_S)

    dumped = daemon.ctl("dump", "--name", "ddp-a")
    assert dumped.rc == 0, f"ckptctl dump --name ddp-a failed: {dumped.err.strip()}"
    # a dump by name without --leave-running is a drain: its result names the checkpoint
    timing("(a) dump --name", assert_ok(daemon.ctl("show", dumped.out["id"]), "show"))
    assert launcher.wait(timeout=60) == 143, "ckptctl run reports the job checkpointed"
    assert not is_alive(agent)
    extra = ["--lazy"] if lazy else []
    restored = assert_ok(daemon.ctl("restore", "--name", "ddp-a", *extra),
                         f"restore --name ddp-a {' '.join(extra)}")
    timing(f"(a) restore --name{' --lazy' if lazy else ''}", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == agent and restored["lazy"] is lazy

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "torchrun DDP restored by name")


@pytest.mark.parametrize("lazy", [False, True], ids=["restore", "restore-lazy"])
def test_b_dataloader_with_two_workers(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path, lazy: bool
) -> None:
    """With ``lazy``: ``ckptctl restore --lazy``, the loop and its forked workers running
    before their memory is back (PyTorch's shared memory comes back whole), bit for bit."""
    want = references.get("dataloader", DL_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    pid = start_detached(procs, dataloader_cmd(out_dir, DL_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)
    assert len(descendants(pid)) == 2, "the loop and its 2 DataLoader workers"

    dumped = assert_ok(daemon.ctl("dump", pid, "--name", "dl-b"), "dump")
    timing("(b) dump", dumped)
    assert not is_alive(pid)
    extra = ["--lazy"] if lazy else []
    restored = assert_ok(daemon.ctl("restore", "--name", "dl-b", *extra), "restore --name dl-b")
    timing(f"(b) restore{' --lazy' if lazy else ''}", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == pid and restored["lazy"] is lazy

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "DataLoader job restored")


def test_c_node_failure_after_a_leave_running_checkpoint_with_files(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path
) -> None:
    want = references.get("dataloader", DL_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    pid = start_detached(procs, dataloader_cmd(out_dir, DL_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)

    dumped = assert_ok(daemon.ctl("dump", pid, "--name", "nf-c", "--leave-running"),
                       "dump --leave-running")
    timing("(c) dump --leave-running", dumped)
    after = len(wait_for_lines(stdout, 1)) + 3
    wait_for_lines(stdout, after, timeout=30)  # the job writes on past its checkpoint
    kill_tree(pid)  # the node fails
    paths = [stdout, *(out_dir / n for n in JOB_FILES)]
    on_disk = {p: p.read_bytes() for p in paths}
    assert not on_disk[stdout].endswith(want.stdout[-40:]), "the job finished before the kill"

    checked = daemon.ctl("check-restore", dumped["id"])
    assert checked.rc == 0, f"check-restore: {checked.out or checked.err}"
    restored = assert_ok(daemon.ctl("restore", "--name", "nf-c"), "restore --name nf-c")
    timing("(c) restore", restored)
    procs.add(restored["pid"])

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "job restored after the failure")
    for path, content in on_disk.items():
        assert_kept_aside(path, content)


def test_d_just_in_time_sigterm_to_ckptctl_run_whose_line_lands_in_the_jobs_log(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path
) -> None:
    want = references.get("dataloader", DL_STEPS)
    out_dir, job_log = tmp_path / "out", tmp_path / "job.log"
    launcher = procs.popen(
        ["sh", "-c", 'exec "$@" > "$LOG" 2>&1', "sh", str(CKPTCTL), "--socket",
         str(daemon.socket), "run", "--name", "jit-d", "--",
         *dataloader_cmd(out_dir, DL_STEPS)],
        stdin=subprocess.DEVNULL, env={**os.environ, "LOG": str(job_log)},
    )
    job = child_of(launcher.pid)
    wait_for_lines(job_log, 5, timeout=START_S)

    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 143, job_log.read_text()[-500:]
    assert not is_alive(job)
    on_disk = job_log.read_bytes()
    assert b"checkpointed as ck-" in on_disk.splitlines()[-1], "ckptctl run's own line"

    restored = assert_ok(daemon.ctl("restore", "--name", "jit-d"), "restore --name jit-d")
    timing("(d) restore --name", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == job

    wait_for_done(job_log, timeout=START_S)
    assert_same_outcome(Outcome.read(job_log, out_dir), want, "job restored by name")
    assert_kept_aside(job_log, on_disk)


@pytest.mark.parametrize(("kind", "command", "processes"), [
    ("big-batches", big_batches_cmd, 3),  # (f) the loop and its 2 forked workers
    ("shared-spawn", shared_spawn_cmd, 2),  # (g) the main process and the spawned one
])
def test_f_g_torch_shared_memory_over_1_mib_dumped_as_ghost_files(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path, kind: str,
    command: Callable[..., list[str]], processes: int,
) -> None:
    want = references.get(kind, SHM_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    pid = start_detached(procs, command(out_dir, SHM_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)
    assert len(descendants(pid)) + 1 >= processes, f"{kind}: {processes} processes"

    dumped = assert_ok(daemon.ctl("dump", pid, "--name", kind), "dump")
    timing(f"{kind} dump", dumped)
    assert not is_alive(pid)
    restored = assert_ok(daemon.ctl("restore", "--name", kind), f"restore --name {kind}")
    timing(f"{kind} restore", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == pid

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, f"{kind} job restored")


def test_g_a_ghost_file_over_the_limit_refuses_the_dump_naming_the_setting(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path,
) -> None:
    """The 8 MiB tensor of (g) under a daemon with ``ghost_limit`` 4 MiB: one line naming
    the file, its size, the limit and the setting; the job runs on to its end."""
    daemon = start_daemon(config={"ghost_limit": 4 << 20})
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    pid = start_detached(procs, shared_spawn_cmd(out_dir, SHM_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)

    line = assert_one_line_error(daemon.ctl("dump", pid), 1, f"pid {pid}", "/dev/shm/torch_",
                                 "8.0 MiB", "4.0 MiB", "ghost_limit", "daemon's configuration")
    assert "increase limit" not in line
    assert is_alive(pid), "the job keeps running"
    assert wait_for_done(stdout, timeout=START_S)[-1].startswith("done steps")


@pytest.fixture
def nodes() -> Iterator[TwoNodes]:
    with TwoNodes() as pair:
        yield pair


def test_e_ddp_ranks_on_two_nodes_group_checkpoint_and_group_restore(
    start_daemon: Callable[..., Daemon], nodes: TwoNodes, procs: Procs,
    references: References, tmp_path: Path,
) -> None:
    want = references.get("ddp", DDP_STEPS)
    a = start_daemon(config={"node": "node-a"}, preexec_fn=in_netns(nodes.a.name))
    b = start_daemon(config={"node": "node-b"}, preexec_fn=in_netns(nodes.b.name))
    out_dir, stdout = tmp_path / "out", tmp_path / "rank0.out"
    ranks = [
        start_detached(
            procs, rank_cmd(out_dir, DDP_STEPS, rank, nodes.a.address, STORE_PORT, ifname),
            tmp_path / f"rank{rank}.out", in_netns(node.name))
        for rank, (node, ifname) in enumerate(((nodes.a, nodes.veth_a), (nodes.b, nodes.veth_b)))
    ]
    wait_for_lines(stdout, 5, timeout=START_S)

    with Client(str(a.socket)) as ca, Client(str(b.socket)) as cb:
        group = group_checkpoint(list(zip((ca, cb), ranks, strict=True)), name="ddp-e")
        assert not any(is_alive(pid) for pid in ranks), "both ranks are stopped"
        restored = group_restore(group, [ca, cb])
    for pid in restored.values():
        procs.add(pid)
    assert sorted(restored.values()) == sorted(ranks)

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "DDP group restored")
    assert (tmp_path / "rank1.out").read_bytes() == b"", "rank 1 prints nothing"



SEM_STEPS = 30


def _dump_leftovers() -> set[str]:
    """What of a dump's may lie in /dev/shm: CRIU's link-remap files and the job's named
    semaphores."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("link_remap.", "sem.mp-"))}


@pytest.mark.parametrize("leave_running", [False, True], ids=["dump", "leave-running-kill"])
def test_h_spawn_context_queues_named_semaphores_restored_bit_for_bit(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path, leave_running: bool,
) -> None:
    """(h) multiprocessing's spawn context (issue 34, 1 and 2): its Queues' named POSIX
    semaphores are mapped through an unlinked name while still linked as /dev/shm/sem.mp-*.
    A plain dump, and a leave-running checkpoint followed by the job's death, both restore
    with the defaults, bit for bit; nothing of the dump is left in /dev/shm once the job ends
    (its semaphores are the job's own, removed by its resource tracker)."""
    before = _dump_leftovers()
    want = references.get("spawn-queue", SEM_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    pid = start_detached(procs, spawn_queue_cmd(out_dir, SEM_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)
    extra = ["--leave-running"] if leave_running else []
    dumped = assert_ok(daemon.ctl("dump", pid, "--name", "sem-h", *extra), "dump")
    timing(f"(h) dump {' '.join(extra)}", dumped)
    if leave_running:
        wait_for_lines(stdout, len(wait_for_lines(stdout, 1)) + 2, timeout=30)
        kill_tree(pid)
    assert not is_alive(pid)
    checked = daemon.ctl("check-restore", dumped["id"])
    assert checked.rc == 0, f"check-restore: {checked.out or checked.err}"
    restored = assert_ok(daemon.ctl("restore", "--name", "sem-h"), "restore --name sem-h")
    timing("(h) restore", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == pid

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "spawn-context job restored")
    deadline = time.monotonic() + 10
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _dump_leftovers() - before
    assert not any(n.startswith("link_remap.") for n in left), f"left in /dev/shm: {left}"


def _events(daemon: Daemon) -> list[dict[str, Any]]:
    """The daemon's last events, as ``ckptctl --json events`` gives them (a JSON line each)."""
    res = daemon.ctl("events", "--last", "200")
    assert res.rc == 0, res.err
    text = res.out if isinstance(res.out, str) else json.dumps(res.out)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_i_a_log_shared_with_a_writer_outside_the_tree_keeps_the_other_writers_lines(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path
) -> None:
    """(i) issue 34 (3) on a training job: its train.log is also held open for appending by
    a process outside its tree (a service sharing the log), which writes lines on cue. A
    leave-running checkpoint, both write on, the job's tree is killed, the other writes
    again, restore. With the default ``shared_files = "keep"`` the log is not rolled back:
    every line the other process wrote is still there, in order, nothing of the file as it
    was at the restore is lost, and the restored job appends its steps from the checkpoint
    after it; its stdout and state.bin are put back and end as an uninterrupted run's, bit
    for bit. The dump, ``show``, ``check-restore``, the restore's result and its
    ``restore.done`` event name the other writer's pid."""
    want = references.get("dataloader", DL_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    log = out_dir / LOG_NAME
    pid = start_detached(procs, dataloader_cmd(out_dir, DL_STEPS), stdout)
    wait_for_lines(stdout, 5, timeout=START_S)
    other = OutsideWriter(procs, log)
    other.append("outside 1: before the checkpoint")
    writer = f"pid {other.pid} ("

    low = len(wait_for_lines(stdout, 1))
    dumped = assert_ok(daemon.ctl("dump", pid, "--name", "shared-i", "--leave-running"),
                       "dump --leave-running")
    high = len(wait_for_lines(stdout, 1))
    timing("(i) dump --leave-running", dumped)
    [captured] = [f for f in dumped["files"] if f["path"] == str(log)]
    assert any(w.startswith(writer) for w in captured["writers"]), captured
    for n in (2, 3, 4):  # both write on past the checkpoint, interleaved
        wait_for_lines(stdout, high + n, timeout=30)
        other.append(f"outside {n}: after the checkpoint")
    kill_tree(pid)  # the job's tree only: the other writer is not in it
    other.append("outside 5: after the job died")
    before_restore = log.read_bytes()
    killed_at = sum(1 for line in before_restore.splitlines() if line.startswith(b"step "))
    assert not stdout.read_bytes().endswith(want.stdout[-40:]), "the job finished before the kill"

    shown = assert_ok(daemon.ctl("show", dumped["id"]), "show")
    [listed] = [f for f in shown["files"] if f["path"] == str(log)]
    assert any(w.startswith(writer) for w in listed["writers"]), listed
    report = assert_ok(daemon.ctl("check-restore", dumped["id"]), "check-restore")
    assert report["compatible"] is True, report
    [note] = [n for n in report["notes"] if str(log) in n]
    assert writer in note and "leaves it as it is" in note, report

    restored = assert_ok(daemon.ctl("restore", "--name", "shared-i"), "restore --name shared-i")
    timing("(i) restore", restored)
    procs.add(restored["pid"])
    assert restored["pid"] == pid
    [left] = restored["files_left"]
    assert left.startswith(f"{log} (written by {writer}"), restored
    assert str(log) not in restored["files_put_back"], restored
    assert {str(stdout), str(out_dir / STATE_NAME)} <= set(restored["files_put_back"]), restored
    [done_event] = [e for e in _events(daemon) if e["kind"] == "restore.done"
                    and e["checkpoint_id"] == dumped["id"]]
    assert ("left as found, written by a process outside the checkpoint (shared_files = "
            f"keep): {log} (written by {writer}") in done_event["message"], done_event
    other.append("outside 6: while the restored job runs")

    wait_for_done(stdout, timeout=START_S)
    got = Outcome.read(stdout, out_dir)
    assert_same_bytes(got.stdout, want.stdout, "(i) stdout")
    assert_same_bytes(got.files[STATE_NAME], want.files[STATE_NAME], f"(i) {STATE_NAME}")
    final = got.files[LOG_NAME]
    assert final.startswith(before_restore), "the shared log was rolled back by the restore"
    lines = final.decode().splitlines()
    assert [x for x in lines if x.startswith("outside ")] == other.lines, final.decode()
    ours = [f"{x}\n".encode() for x in lines if not x.startswith("outside ")]
    ref = want.files[LOG_NAME].splitlines(keepends=True)
    point = len(ref) - (len(ours) - killed_at)  # the steps logged at the checkpoint
    assert low - 1 <= point <= high, (
        f"the restored job logs from step {point + 1}; {low} lines were printed before the "
        f"dump, {high} when it returned")
    assert_same_bytes(b"".join(ours), b"".join(ref[:killed_at] + ref[point:]),
                      f"(i) the job's lines of {LOG_NAME} (to the kill, then from the "
                      "checkpoint)")
    assert not list(out_dir.glob(f"{LOG_NAME}.*")), "nothing of the shared log kept aside"


PERIODIC_PACE = 0.5
"""(j): 40 steps take 20 s, so the second periodic checkpoint (10 s after the first, which
comes as the job starts) lands mid-run."""


@pytest.mark.parametrize("kill", ["process-group", "loop-only"])
def test_j_resume_after_the_job_is_sigkilled_under_ckptctl_run_every(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path, kill: str
) -> None:
    """(j) issue 34 (4) on a training job: ``ckptctl run --name J --every 10s`` (10 s: the
    shortest period the daemon takes), the job SIGKILLed (not ``run``) once a periodic
    checkpoint holds its files: ``process-group``, the loop and its DataLoader workers at
    once (``kill -9 -PGID``, an OOM kill of the job's cgroup); ``loop-only``, the loop alone
    (the OOM killer's pick), its workers then ending on their own. ``run`` exits 137 naming
    the newest checkpoint and ``ckptctl resume J``; ``check-restore`` finds it compatible;
    ``ckptctl resume J`` restores that checkpoint — the job's files put back as they were
    at it — and the job ends as an uninterrupted run, bit for bit. With ``loop-only`` the
    workers, ending on their own, remove their ``/tmp/pymp-*`` directories, where the
    checkpoint's workers have a unix socket bound (multiprocessing's resource sharer): the
    restore makes each again, ``0700`` and the job owner's, before CRIU binds there
    (``pathpins.ProcPinnedPaths.socket_dir``)."""
    want = references.get("dataloader", DL_STEPS)
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        launcher = procs.popen(
            [str(CKPTCTL), "--socket", str(daemon.socket), "run", "--name", "every-j",
             "--every", "10s", "--", *dataloader_cmd(out_dir, DL_STEPS, pace=PERIODIC_PACE)],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.PIPE)
    finally:
        os.close(fd)
    job = child_of(launcher.pid)

    def policy() -> dict[str, Any]:
        listed = assert_ok(daemon.ctl("policy", "show"), "policy show")
        return next(p for p in listed if p["name"] == "every-j")

    def holds_the_files(ck: str) -> bool:
        shown = assert_ok(daemon.ctl("show", ck), "show")
        return {str(out_dir / n) for n in JOB_FILES} <= {f["path"] for f in shown["files"]}

    seen: set[str] = set()

    def periodic_with_files() -> bool:
        ck = policy().get("last_checkpoint_id") or ""
        if not ck or ck in seen:
            return False
        seen.add(ck)
        return holds_the_files(ck)  # the first one may come before the job opened them

    wait_until(periodic_with_files, START_S, "a periodic checkpoint holding the job's files",
               interval=0.2)
    listed = assert_ok(daemon.ctl("list", "--name", "every-j"), "list --name every-j")
    assert seen <= {c["id"] for c in listed}, listed
    wait_for_lines(stdout, len(wait_for_lines(stdout, 1)) + 2, timeout=30)  # past it
    workers = descendants(job)
    assert len(workers) == 2, "the loop's 2 DataLoader workers"
    assert os.getpgid(job) == job, "the job leads its own process group (ckptctl run)"
    if kill == "process-group":
        os.killpg(job, signal.SIGKILL)
    else:
        os.kill(job, signal.SIGKILL)
    wait_until(lambda: not any(is_alive(w) for w in [job, *workers]), 30,
               "the job's processes to end")
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 137, err
    on_disk = stdout.read_bytes()
    assert not on_disk.endswith(want.stdout[-40:]), "the job finished before the kill"
    kept = policy()["last_checkpoint_id"]
    assert kept in {c["id"] for c in assert_ok(daemon.ctl("list", "--name", "every-j"),
                                               "list")}
    assert (f"every-j (pid {job}) was killed by SIGKILL; its newest checkpoint is {kept}: "
            "`ckptctl resume every-j` restores it").encode() in err, err

    report = assert_ok(daemon.ctl("check-restore", kept), "check-restore")
    assert report["compatible"] is True, report
    resuming = daemon.ctl("resume", "every-j")
    resumed = assert_ok(resuming, "resume every-j")
    assert resumed["errors"] == [], resumed
    [restored] = resumed["restored"]
    procs.add(restored["pid"])
    timing("(j) resume", restored)
    assert restored["id"] == kept and restored["pid"] == job, restored

    wait_for_done(stdout, timeout=START_S)
    assert_same_outcome(Outcome.read(stdout, out_dir), want, "job resumed after SIGKILL")
    assert_kept_aside(stdout, on_disk)
    assert_ok(daemon.ctl("policy", "clear", "every-j"), "policy clear")


def test_k_a_metrics_csv_opened_and_closed_each_step_is_rolled_back_by_run_files(
    daemon: Daemon, procs: Procs, references: References, tmp_path: Path
) -> None:
    """(k) ``--files`` on a training job: the DataLoader loop of (j) also logs each step to
    ``metrics.csv`` with the ``csv`` module, the file opened for appending, written and
    closed each step — so between steps no descriptor of it exists, and only ``--files``
    captures it. ``ckptctl run --name k-job --every 10s --files OUT_DIR``; once a periodic
    checkpoint lists the CSV, the job logs two steps more and its process group is
    SIGKILLed; ``run`` exits 137 naming the checkpoint, ``ckptctl resume k-job`` puts the
    CSV back as it was at the checkpoint (the rows logged after it kept aside), and the job
    ends as an uninterrupted run, bit for bit: stdout, train.log, state.bin and the CSV, no
    step logged twice. Without the CSV rolled back the steps between the checkpoint and the
    kill would be in it twice."""
    kind = "metrics-csv"
    names = References.files(kind)
    want = references.get(kind, DL_STEPS)
    want_rows = want.files[METRICS_NAME].splitlines(keepends=True)
    assert [r.split(b",")[0] for r in want_rows] == [
        str(n).encode() for n in range(1, DL_STEPS + 1)], "the reference logs each step once"
    out_dir, stdout = tmp_path / "out", tmp_path / "stdout"
    out_dir.mkdir()
    metrics = out_dir / METRICS_NAME
    fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        launcher = procs.popen(
            [str(CKPTCTL), "--socket", str(daemon.socket), "run", "--name", "k-job",
             "--every", "10s", "--files", str(out_dir), "--",
             *metrics_csv_cmd(out_dir, DL_STEPS, pace=PERIODIC_PACE)],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.PIPE)
    finally:
        os.close(fd)
    job = child_of(launcher.pid)

    def policy() -> dict[str, Any]:
        listed = assert_ok(daemon.ctl("policy", "show"), "policy show")
        return next(p for p in listed if p["name"] == "k-job")

    def captured(ck: str) -> dict[str, int]:
        """The sizes of the files of OUT_DIR checkpoint ``ck`` holds, by name."""
        shown = assert_ok(daemon.ctl("show", ck), "show")
        return {Path(f["path"]).name: f["size"] for f in shown["files"]
                if Path(f["path"]).parent == out_dir}

    def rows(data: bytes) -> int:
        return data.count(b"\n")

    assert policy()["files_dirs"] == [str(out_dir)]
    seen: set[str] = set()

    def periodic_with_the_csv() -> bool:
        ck = policy().get("last_checkpoint_id") or ""
        if not ck or ck in seen:
            return False
        seen.add(ck)  # the first one may come before the job wrote its first step
        return set(names) <= set(captured(ck))

    wait_until(periodic_with_the_csv, START_S, "a periodic checkpoint holding metrics.csv",
               interval=0.2)

    def two_rows_past_the_newest_checkpoint() -> bool:
        size = captured(policy()["last_checkpoint_id"]).get(METRICS_NAME, 0)
        return rows(metrics.read_bytes()) >= rows(want.files[METRICS_NAME][:size]) + 2

    wait_until(two_rows_past_the_newest_checkpoint, 30, "two more steps in metrics.csv",
               interval=0.1)
    workers = descendants(job)
    assert len(workers) == 2, "the loop's 2 DataLoader workers"
    assert os.getpgid(job) == job, "the job leads its own process group (ckptctl run)"
    os.killpg(job, signal.SIGKILL)
    wait_until(lambda: not any(is_alive(w) for w in [job, *workers]), 30,
               "the job's processes to end")
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 137, err
    on_disk = stdout.read_bytes()
    on_disk_csv = metrics.read_bytes()
    assert not on_disk.endswith(want.stdout[-40:]), "the job finished before the kill"
    kept = policy()["last_checkpoint_id"]
    assert (f"k-job (pid {job}) was killed by SIGKILL; its newest checkpoint is {kept}: "
            "`ckptctl resume k-job` restores it").encode() in err, err
    at_checkpoint = captured(kept)[METRICS_NAME]
    assert want.files[METRICS_NAME].startswith(on_disk_csv), "metrics.csv before the resume"
    assert rows(on_disk_csv) >= rows(want.files[METRICS_NAME][:at_checkpoint]) + 2, (
        f"metrics.csv holds {rows(on_disk_csv)} rows at the kill, its checkpoint "
        f"{at_checkpoint} bytes: nothing for the resume to roll back")

    report = assert_ok(daemon.ctl("check-restore", kept), "check-restore")
    assert report["compatible"] is True, report
    resumed = assert_ok(daemon.ctl("resume", "k-job"), "resume k-job")
    assert resumed["errors"] == [], resumed
    [restored] = resumed["restored"]
    procs.add(restored["pid"])
    timing("(k) resume", restored)
    assert restored["id"] == kept and restored["pid"] == job, restored
    assert str(metrics) in restored["files_put_back"], restored

    wait_for_done(stdout, timeout=START_S)
    got = Outcome.read(stdout, out_dir, names)
    logged = [r.split(b",")[0] for r in got.files[METRICS_NAME].splitlines()]
    assert len(logged) == len(set(logged)), f"steps logged twice in metrics.csv: {logged}"
    assert_same_outcome(got, want, "job with a per-step CSV resumed after SIGKILL")
    assert_kept_aside(stdout, on_disk)
    assert_kept_aside(metrics, on_disk_csv)
    assert_ok(daemon.ctl("policy", "clear", "k-job"), "policy clear")
