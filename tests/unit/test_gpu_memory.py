"""Issue 23, point 3: device memory lands in the job's memory cgroup (the driver copies it
into host allocations of the process at checkpoint). A dump refuses, before anything is
locked or frozen, a job whose cgroup cannot hold it; a restore counts it with the resident
memory when it checks a container's memory limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core.intocontainer import CRIU_MEMORY_MARGIN, CallerContainer, memory_problems
from ckptd.domain import CudaState, PidState
from ckptd.errors import GpuFailed, TargetRefused
from ckptd.testing import FakeGpu

from .world import DAEMON_CGROUP, JOB, JOB_TREE, World, make_world

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture
def gw(tmp_path: Path) -> World:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    world.gpu.add_cuda_process(1000, 2 * GIB)
    world.gpu.add_cuda_process(1002, 1 * GIB)
    return world


def gpu(w: World) -> FakeGpu:
    assert w.gpu is not None
    return w.gpu


def test_a_cgroup_that_cannot_hold_the_device_memory_is_refused_before_freezing(
    gw: World,
) -> None:
    gw.cgroups.place(1000, "/jobs/train")
    gw.cgroups.place(1001, "/jobs/train")
    gw.cgroups.place(1002, "/jobs/train")
    gw.cgroups.limits["/jobs"] = (4 * GIB, 2 * GIB + 800 * MIB)
    with pytest.raises(TargetRefused) as info:
        gw.dump(JOB, leave_running=True)
    text = str(info.value)
    assert "\n" not in text
    assert "the cgroup of pids 1000, 1002 /jobs can hold 1.2 GiB more" in text
    assert "(limit 4 GiB, 2.8 GiB used)" in text
    assert "needs 3 GiB of host memory for device memory" in text
    assert "raise memory.max of /jobs to at least 5.8 GiB" in text
    assert info.value.pid == JOB
    # nothing was touched: no lock, no CRIU, the tree runs, nothing listed
    assert [m for m, _ in gpu(gw).calls if m in ("lock", "checkpoint")] == []
    assert gw.criu.dump_jobs == []
    assert gw.states(*JOB_TREE) == ["running"] * 3
    assert [gpu(gw).cuda_state(p) for p in (1000, 1002)] == [CudaState.RUNNING] * 2
    assert gw.store.list() == []


def test_one_process_names_its_own_cgroup(gw: World) -> None:
    gw.cgroups.place(1002, "/jobs/helper")
    gw.cgroups.limits["/jobs/helper"] = (GIB + 512 * MIB, GIB)
    with pytest.raises(TargetRefused, match=r"pid 1002's cgroup /jobs/helper can hold "
                                            r"512 MiB more \(limit 1\.5 GiB, 1 GiB used\) "
                                            r"but its CUDA checkpoint needs 1 GiB"):
        gw.dump(JOB, leave_running=True)


def test_a_cgroup_with_room_for_the_device_memory_is_dumped(gw: World) -> None:
    gw.cgroups.limits[DAEMON_CGROUP] = (8 * GIB, 4 * GIB)
    record = gw.dump(JOB, leave_running=True)
    assert record.gpu is not None


def test_a_restore_into_a_container_counts_the_device_memory(gw: World) -> None:
    """The resident memory recorded was read before the checkpoint copied device memory
    into the processes: the restored tree holds both."""
    record = gw.dump(JOB)
    resident = sum(p.rss for p in record.processes)
    gw.cgroups.spawn(7000, "/kubepods/pod-b")
    into = CallerContainer(init=7000, start_time=0)
    room = resident + CRIU_MEMORY_MARGIN + 2 * GIB  # less than the 3 GiB of device memory
    gw.cgroups.limits["/kubepods/pod-b"] = (room, 0)
    (problem,) = memory_problems(gw.cgroups, into, record)
    assert "plus 3072 MiB of device memory" in problem
    gw.cgroups.limits["/kubepods/pod-b"] = (room + GIB, 0)
    assert memory_problems(gw.cgroups, into, record) == []


# ---- issue 23, point 2: CUDA comes back in a held process (docs/adr/0019; the class doc
# of ckptd.testing.FakeGpu) ------------------------------------------------------------------


def test_cuda_comes_back_with_only_the_restore_thread_running(gw: World) -> None:
    """The driver restores and unlocks on the process's own restore thread, while every
    other thread of it is held (none of the job's code runs before its CUDA state is back).
    Dump (leave-running), a rollback and a restore each do so, and release every hold."""
    gw.dump(JOB, leave_running=True)
    gw.criu.fail_dump = RuntimeError("boom")
    with pytest.raises(Exception, match="boom"):
        gw.dump(JOB, leave_running=True)
    gw.criu.fail_dump = None
    record = gw.dump(JOB)
    gw.restore(checkpoint_id=record.id)
    fake = gpu(gw)
    assert fake.while_stopped == [] and fake.while_unheld == []
    assert [fake.cuda_state(p) for p in (1000, 1002)] == [CudaState.RUNNING] * 2
    assert [m for m, _ in fake.calls].count("restore") == 6
    assert fake.threads is not None and fake.threads.held == {}
    holds = [(p, t) for what, p, t in fake.threads.history if what == "hold"]
    assert holds == [(p, p + 1_000_000) for p in (1002, 1000)] * 3
    assert all(gw.processes.status(p).state is PidState.RUNNING for p in JOB_TREE)


def test_a_restored_tree_runs_only_once_its_cuda_is_back(gw: World) -> None:
    """The restore's order (CRIU's CUDA plugin's): CRIU leaves the tree stopped; the CUDA
    processes' threads are held but the restore threads; SIGCONT; restore and unlock; the
    holds released; then the tree runs."""
    record = gw.dump(JOB)
    gw.events.clear()
    gw.restore(checkpoint_id=record.id)
    order = [e for e in gw.events if e.split(" ")[0] in (
        "threads.hold", "threads.release", "gpu.restore", "gpu.unlock")]
    assert order == ["threads.hold 1002", "threads.hold 1000",
                     "gpu.restore 1002", "gpu.unlock 1002",
                     "gpu.restore 1000", "gpu.unlock 1000",
                     "threads.release 1002", "threads.release 1000"]
    assert all(gw.processes.status(p).state is PidState.RUNNING for p in JOB_TREE)


def test_a_failed_cuda_restore_kills_a_tree_that_never_ran(gw: World) -> None:
    record = gw.dump(JOB)
    gpu(gw).fail_restore.add(1000)
    with pytest.raises(GpuFailed):
        gw.restore(checkpoint_id=record.id)
    assert all(gw.processes.status(p).state is PidState.FREE for p in JOB_TREE)
    assert gpu(gw).threads is not None and gpu(gw).threads.held == {}


def test_the_fake_driver_needs_the_restore_thread_running_and_the_others_held(
        gw: World) -> None:
    fake = gpu(gw)
    assert fake.threads is not None
    fake.lock(1000, 1000)
    fake.checkpoint(1000)
    with pytest.raises(GpuFailed, match="not held") as info:
        fake.restore(1000)  # its other threads run
    assert info.value.code == "CUDA_ERROR_NOT_READY"
    fake.threads.hold(1000, 1000)  # the restore thread held, the main one not
    with pytest.raises(GpuFailed, match="restore thread cannot run"):
        fake.restore(1000)
    fake.threads.release(1000)
    fake.threads.hold(1000, fake.restore_thread(1000))
    gw.processes.processes[1000].state = PidState.STOPPED
    with pytest.raises(GpuFailed, match="restore thread cannot run"):
        fake.restore(1000)
    assert fake.cuda_state(1000) is CudaState.CHECKPOINTED
    gw.processes.processes[1000].state = PidState.RUNNING
    fake.restore(1000)
    gw.processes.processes[1000].state = PidState.STOPPED
    with pytest.raises(GpuFailed, match="restore thread cannot run"):
        fake.unlock(1000)
    assert fake.while_stopped == [("restore", 1000), ("restore", 1000), ("unlock", 1000)]
    assert fake.while_unheld == [("restore", 1000)]
    assert fake.cuda_state(1000) is CudaState.LOCKED
