"""A restore into the caller's container (issue #12, the restore half), over the fakes: the
caller must be a container's init; the tree's pids must be free there, the files it maps
unchanged in the container's root, its memory limit big enough; then CRIU runs inside it
(``CriuRestoreJob.container``), stdio comes from the caller, the captured files are put back
in the container's root, and the tree is the caller's child. Every refusal comes before
anything is touched, the checkpoint kept."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.core.intocontainer import CRIU_MEMORY_MARGIN
from ckptd.core.ports import CriuPlacement
from ckptd.domain import Caller, FileKind, RestoreOutcome, RestoreRequest
from ckptd.errors import CriuFailed, GpuMismatch, Incompatible, PidInUse, PreconditionFailed
from ckptd.testing import FakeGpu, FakeNodeInspector

from .world import World, make_world

CONTAINER = frozenset({"pid", "mnt", "net", "ipc", "uts", "cgroup"})
A_INIT, JOB, CHILD = 6000, 6001, 6002
B_INIT = 7000
ROOT_CALLER = Caller(uid=0, pid=B_INIT)


def _checkpoint_in_a(world: World) -> str:
    """Container A (init 6000) runs the job 6001 (pid 1001 in A) and its child (1002); it is
    checkpointed (killed), then A's init ends."""
    world.processes.add_process(A_INIT, 1, comm="ckptctl", ns_pid=1, namespaces=CONTAINER)
    for pid, ns_pid, parent in ((JOB, 1001, A_INIT), (CHILD, 1002, JOB)):
        world.processes.add_process(pid, parent, comm="ctjob", ns_pid=ns_pid,
                                    namespaces=CONTAINER, ns_owner=A_INIT,
                                    pidns_init=A_INIT, session=1001)
    record = world.dump(JOB, name="train")
    for pid in (CHILD, JOB, A_INIT):
        world.processes.remove(pid)
    return record.id


def _container_b(world: World) -> None:
    world.processes.add_process(B_INIT, 1, comm="ckptctl", ns_pid=1, namespaces=CONTAINER)
    world.cgroups.place(B_INIT, "/kubepods/pod-b/ctr")


def _restore_into_b(world: World, caller: Caller = ROOT_CALLER, name: str = "train"
                    ) -> RestoreOutcome:
    world.clock.advance(1.0)
    return world.service.restore(
        caller, RestoreRequest(name=name, into_callers_container=True))


def _nothing_touched(world: World, ck: str) -> None:
    assert world.criu.restore_jobs == []
    assert [r.id for r in world.store.list()] == [ck]
    assert [p for p, proc in world.processes.processes.items() if proc.comm == "ctjob"] == []


def test_the_tree_comes_back_as_the_callers_child_in_its_namespaces(world: World) -> None:
    ck = _checkpoint_in_a(world)
    _container_b(world)
    outcome = _restore_into_b(world)
    (job,) = world.criu.restore_jobs
    start = world.processes.processes[B_INIT].start_time
    assert job.container == CriuPlacement(init=B_INIT, init_start_time=start, ns_pid=0)
    assert not job.restore_cgroups  # CRIU's entry is in B's cgroups; cgroups left alone
    assert outcome.checkpoint_id == ck and outcome.ns_pid == 1001
    root = world.processes.processes[outcome.pid]
    assert root.ppid == B_INIT and root.pidns_init == B_INIT and root.ns_pid == 1001
    assert root.namespaces == CONTAINER
    assert outcome.cgroup == "/kubepods/pod-b/ctr"
    assert outcome.output_path == ""  # stdio is the container's own
    (calls,) = world.stdio.from_calls
    assert calls[1] == B_INIT


def test_a_caller_that_is_not_a_containers_init_is_refused(world: World) -> None:
    ck = _checkpoint_in_a(world)
    _container_b(world)
    world.processes.add_process(7001, B_INIT, comm="sh", ns_pid=5, namespaces=CONTAINER,
                                ns_owner=B_INIT, pidns_init=B_INIT)
    with pytest.raises(PreconditionFailed, match="is pid 5 of its container, not its init"):
        _restore_into_b(world, Caller(uid=0, pid=7001))
    world.processes.add_process(7100, 1, comm="bash")
    with pytest.raises(PreconditionFailed, match="is not in a container"):
        _restore_into_b(world, Caller(uid=0, pid=7100))
    with pytest.raises(PreconditionFailed, match="pid is unknown to the daemon"):
        _restore_into_b(world, Caller(uid=0, pid=0))
    _nothing_touched(world, ck)


def test_a_rootless_container_is_refused(world: World) -> None:
    ck = _checkpoint_in_a(world)
    world.processes.add_process(B_INIT, 1, comm="ckptctl", ns_pid=1,
                                namespaces=CONTAINER | {"user"})
    with pytest.raises(PreconditionFailed, match="user namespace of its own"):
        _restore_into_b(world)
    _nothing_touched(world, ck)


def test_a_checkpoint_of_a_job_outside_containers_is_not_restored_into_one(
    world: World
) -> None:
    world.processes.add_process(5000, 1, comm="job")
    world.dump(5000, name="plain")
    _container_b(world)
    with pytest.raises(PreconditionFailed, match="outside containers"):
        _restore_into_b(world, name="plain")
    assert world.criu.restore_jobs == []


def test_a_pid_of_the_tree_taken_in_the_container_is_refused(world: World) -> None:
    ck = _checkpoint_in_a(world)
    _container_b(world)
    world.processes.add_process(7002, B_INIT, comm="sidecar", ns_pid=1002,
                                namespaces=CONTAINER, ns_owner=B_INIT, pidns_init=B_INIT)
    with pytest.raises(PidInUse) as info:
        _restore_into_b(world)
    assert "pid 1002 of checkpoint" in str(info.value) and "by sidecar" in str(info.value)
    assert "1 of the tree's 2 pids" in str(info.value)
    _nothing_touched(world, ck)


def test_a_file_the_job_maps_that_differs_in_the_containers_root_is_refused(
    world: World
) -> None:
    """The job maps /app/model.so; the node has it, A had it; B's image has another one."""
    world.node.add_file("/app/model.so", b"weights v1")
    world.node.use(JOB, "/app/model.so", FileKind.MAP)
    ck = _checkpoint_in_a(world)
    _container_b(world)
    b_root = FakeNodeInspector(node=world.node.node)
    b_root.add_file("/app/model.so", b"weights v2!")
    world.node.views[B_INIT] = b_root
    with pytest.raises(Incompatible) as info:
        _restore_into_b(world)
    text = str(info.value)
    assert "does not fit the container of pid 7000" in text
    assert "file /app/model.so" in text
    assert "image the job ran in" in (info.value.hint or "")
    _nothing_touched(world, ck)
    b_root.add_file("/app/model.so", b"weights v1")  # the same image: restored
    assert _restore_into_b(world).ns_pid == 1001


def test_a_memory_limit_too_small_for_the_job_is_refused(world: World) -> None:
    ck = _checkpoint_in_a(world)
    _container_b(world)
    world.cgroups.limits["/kubepods/pod-b"] = (CRIU_MEMORY_MARGIN // 2, 0)
    with pytest.raises(Incompatible, match="free under its memory limit"):
        _restore_into_b(world)
    _nothing_touched(world, ck)
    world.cgroups.limits["/kubepods/pod-b"] = (4 * CRIU_MEMORY_MARGIN, 0)
    assert _restore_into_b(world).ns_pid == 1001


def test_captured_files_go_back_into_the_containers_root(world: World, tmp_path: Path) -> None:
    """The job writes a log (path P as A saw it); B's view of P (``b-root`` + P, a volume
    mounted elsewhere on the node) gets the checkpoint's content back, the version found
    there kept beside it; the node's own P is left as it is."""
    log = tmp_path / "a" / "train.log"
    log.parent.mkdir()
    log.write_bytes(b"step 1\nstep 2\n")
    world.files.open_for_writing(JOB, log, append=True)
    _checkpoint_in_a(world)
    log.write_bytes(b"node's own file\n")
    b_root = tmp_path / "b-root"
    in_b = Path(f"{b_root}{log}")
    in_b.parent.mkdir(parents=True)
    in_b.write_bytes(b"step 1\nstep 2\nstep 3 (lost)\n")
    _container_b(world)
    world.files.roots[B_INIT] = b_root
    outcome = _restore_into_b(world)
    assert outcome.files_put_back == (str(log),)
    assert in_b.read_bytes() == b"step 1\nstep 2\n"
    (kept,) = outcome.files_kept
    assert Path(f"{b_root}{kept}").read_bytes() == b"step 1\nstep 2\nstep 3 (lost)\n"
    assert log.read_bytes() == b"node's own file\n"


def _gpu_world(tmp_path: Path) -> tuple[World, FakeGpu]:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    old = world.gpu.gpus[0]
    world.gpu.gpus = [old, replace(old, index=1, uuid="GPU-11111111-0000-0000-0000-000000000001"),
                      replace(old, index=2, uuid="GPU-22222222-0000-0000-0000-000000000002")]
    world.gpu.add_cuda_process(CHILD, 1 << 30)
    return world, world.gpu


def test_the_gpu_map_follows_the_gpus_the_container_sees(tmp_path: Path) -> None:
    """Pod A used GPU 0; pod B was given GPU 2 only: the restore maps 0 -> 2, and every
    other GPU of the node gets a pair too (the driver's rule): 2 -> 0, the rest onto
    themselves."""
    world, fake = _gpu_world(tmp_path)
    _checkpoint_in_a(world)
    _container_b(world)
    fake.set_visible(B_INIT, [fake.gpus[2].uuid])

    def cuda_state_comes_back_with_the_image(root: int) -> None:
        """CRIU restored the tree with new node pids: its CUDA process is the new one."""
        for pid, proc in world.processes.processes.items():
            if proc.pidns_init == B_INIT and proc.ns_pid == 1002:
                old = fake.cuda.pop(CHILD)
                old.pid = pid
                fake.cuda[pid] = old

    world.hooks.on["post_restore"] = cuda_state_comes_back_with_the_image
    outcome = _restore_into_b(world)
    # the dump asked which GPUs the CUDA process saw (GpuFacts.visible_gpus), the restore
    # which GPUs container B's process sees
    assert fake.visible_calls == [CHILD, B_INIT]
    restored_child = next(p for p, proc in world.processes.processes.items()
                          if proc.ns_pid == 1002 and proc.pidns_init == B_INIT)
    assert outcome.ns_pid == 1001
    g = [x.uuid for x in fake.gpus]
    assert fake.restore_maps[restored_child] == {
        g[0]: g[2], g[2]: g[0], **{u: u for u in g[1:] if u != g[2]}
    }


def test_a_container_without_the_gpus_the_job_needs_is_refused(tmp_path: Path) -> None:
    world, fake = _gpu_world(tmp_path)
    ck = _checkpoint_in_a(world)
    _container_b(world)
    fake.set_visible(B_INIT, [])
    with pytest.raises(GpuMismatch) as info:
        _restore_into_b(world)
    assert "the container sees none of this model (it sees no GPU at all)" in str(info.value)
    _nothing_touched(world, ck)


def test_a_container_that_disappears_mid_restore_leaves_nothing_behind(
    world: World, tmp_path: Path
) -> None:
    """B's init dies while CRIU restores (CRIU fails: its pid namespace is gone): what CRIU
    made is gone, the file put back in B's root is as it was found, the checkpoint kept."""
    log = tmp_path / "a" / "train.log"
    log.parent.mkdir()
    log.write_bytes(b"step 1\n")
    world.files.open_for_writing(JOB, log, append=True)
    ck = _checkpoint_in_a(world)
    b_root = tmp_path / "b-root"
    in_b = Path(f"{b_root}{log}")
    in_b.parent.mkdir(parents=True)
    in_b.write_bytes(b"step 1\nstep 2\n")
    _container_b(world)
    world.files.roots[B_INIT] = b_root
    world.criu.fail_restore = CriuFailed("CRIU restore into the container of pid 7000 failed: "
                                         "Can't fork for 1001: No such process")
    world.criu.fail_restore_after = "setup_namespaces"
    with pytest.raises(CriuFailed, match="No such process"):
        _restore_into_b(world)
    assert in_b.read_bytes() == b"step 1\nstep 2\n"
    assert [p.name for p in in_b.parent.iterdir()] == ["train.log"]  # no copy left aside
    assert [p for p, proc in world.processes.processes.items()
            if proc.pidns_init == B_INIT] == []
    assert [r.id for r in world.store.list()] == [ck]


def test_a_lazy_restore_into_a_container_is_refused_before_anything_is_touched(
    world: World,
) -> None:
    ck = _checkpoint_in_a(world)
    _container_b(world)
    world.criu.streams_restore = True
    world.clock.advance(1.0)
    with pytest.raises(PreconditionFailed,
                       match=rf"cannot restore {ck} lazily: it restores into a container"):
        world.service.restore(ROOT_CALLER, RestoreRequest(
            name="train", into_callers_container=True, lazy=True))
    _nothing_touched(world, ck)
