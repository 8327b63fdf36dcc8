"""A job of a container (issue #12, the dump half): not its pid namespace's init, every other
namespace its init's. The dump is accepted and placed inside the container; the other cases
keep their refusals. Over the fakes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckptd.core.ports import CriuPlacement
from ckptd.domain import Caller, DumpRequest
from ckptd.errors import CgroupUnavailable, InvalidTarget, PreconditionFailed, TargetRefused

from .world import World, make_world

SIGKILL = int(signal.SIGKILL)
CONTAINER = frozenset({"pid", "mnt", "net", "ipc", "uts", "cgroup"})
INIT, JOB, CHILD = 6000, 6001, 6002


def _container(world: World, *, job_ns: frozenset[str] = CONTAINER, owner: int = INIT,
               init_found: int = INIT) -> None:
    """Container init 6000 (``ckptctl run``, pid 1 inside) with the job 6001 (pid 12) and its
    child 6002 (pid 13)."""
    world.processes.add_process(INIT, 1, comm="ckptctl", ns_pid=1, namespaces=CONTAINER)
    world.processes.processes[INIT].own_root = True
    world.processes.add_process(JOB, INIT, comm="sh", ns_pid=12, namespaces=job_ns,
                                ns_owner=owner, pidns_init=init_found, session=12)
    world.processes.add_process(CHILD, JOB, comm="python3", ns_pid=13, namespaces=job_ns,
                                ns_owner=owner, pidns_init=init_found, session=12)


def test_a_job_of_a_container_is_dumped_by_criu_inside_it(world: World) -> None:
    _container(world)
    record = world.dump(JOB)
    (job,) = world.criu.dump_jobs
    start = world.processes.processes[INIT].start_time
    assert job.container == CriuPlacement(init=INIT, init_start_time=start, ns_pid=12)
    assert job.pid == JOB and job.leave_stopped and not job.leave_running
    assert record.container and not record.own_pid_namespace
    assert [(p.pid, p.ns_pid) for p in record.processes] == [(JOB, 12), (CHILD, 13)]
    # killed through the held handles after the commit; the container's init is left alone
    assert world.processes.signals_to(JOB) == [SIGKILL]
    assert world.processes.signals_to(CHILD) == [SIGKILL]
    assert world.processes.signals_to(INIT) == []


def test_a_job_outside_containers_is_dumped_from_the_node(world: World) -> None:
    world.processes.add_process(5000, 1, comm="boxed", ns_pid=1,
                                namespaces=frozenset({"pid", "uts"}))
    record = world.dump(5000)
    assert world.criu.dump_jobs[0].container is None
    assert not record.container


def _refused(world: World, *needles: str) -> None:
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    for needle in needles:
        assert needle in str(info.value)
    assert world.criu.dump_jobs == []
    assert world.processes.signals == []


def test_a_pid_namespace_without_a_mount_namespace_is_not_a_container(world: World) -> None:
    """``unshare --fork --pid`` without --mount: CRIU run in the pid namespace would see the
    node's /proc; refused as before."""
    _container(world, job_ns=frozenset({"pid"}))
    _refused(world, "is pid 12 inside a pid namespace", "not that namespace's init")


def test_a_job_in_namespaces_other_than_its_inits_is_refused(world: World) -> None:
    _container(world, owner=7777)
    _refused(world, "is pid 12 inside a pid namespace", "not that namespace's init")


def test_a_job_whose_pid_namespace_init_is_not_found_is_refused(world: World) -> None:
    _container(world, init_found=0)
    _refused(world, "is pid 12 inside a pid namespace", "not that namespace's init")


@pytest.mark.parametrize("kind", ["user", "time"])
def test_a_rootless_or_time_namespaced_container_is_refused(world: World, kind: str) -> None:
    _container(world, job_ns=CONTAINER | {kind})
    world.processes.processes[INIT].namespaces = CONTAINER | {kind}
    _refused(world, "not that namespace's init")


def test_the_container_given_by_its_init_checkpoints_its_job(world: World) -> None:
    """``ckptctl dump <init>`` (the container's entrypoint, ``ckptctl run``): its only
    child's tree is the job; the init is left alone."""
    _container(world)
    record = world.dump(INIT)
    assert record.pid == JOB and record.container
    assert [p.pid for p in record.processes] == [JOB, CHILD]
    assert world.processes.signals_to(INIT) == []


def test_the_container_given_by_its_cgroup_checkpoints_its_job(world: World) -> None:
    _container(world)
    for pid in (INIT, JOB, CHILD):
        world.cgroups.place(pid, "/kubepods/pod-a/ctr")
    world.clock.advance(1.0)
    record = world.service.dump(Caller(uid=0), DumpRequest(0, cgroup="/kubepods/pod-a/ctr"))
    assert record.pid == JOB and record.container


def test_a_cgroup_without_one_container_init_is_refused(world: World) -> None:
    _container(world)
    world.cgroups.place(JOB, "/kubepods/pod-a/ctr")
    with pytest.raises(InvalidTarget, match="holds no container init"):
        world.service.dump(Caller(uid=0), DumpRequest(0, cgroup="/kubepods/pod-a/ctr"))
    with pytest.raises(InvalidTarget, match="give a pid or a cgroup, not both"):
        world.service.dump(Caller(uid=0), DumpRequest(JOB, cgroup="/kubepods/pod-a/ctr"))
    with pytest.raises(CgroupUnavailable, match="does not exist"):
        world.service.dump(Caller(uid=0), DumpRequest(0, cgroup="/kubepods/nope"))
    assert world.criu.dump_jobs == []


def test_a_container_init_alone_or_with_several_children_is_refused(world: World) -> None:
    world.processes.add_process(INIT, 1, comm="ckptctl", ns_pid=1, namespaces=CONTAINER)
    world.processes.processes[INIT].own_root = True
    with pytest.raises(TargetRefused, match="mount namespace"):  # the init is the job
        world.dump(INIT)
    for pid, ns_pid in ((JOB, 12), (CHILD, 13)):
        world.processes.add_process(pid, INIT, comm="sh", ns_pid=ns_pid, namespaces=CONTAINER,
                                    ns_owner=INIT, pidns_init=INIT, session=ns_pid)
    with pytest.raises(TargetRefused, match=r"with 2 children \(6001 \(sh\), 6002 \(sh\)\)"):
        world.dump(INIT)
    assert world.criu.dump_jobs == []
    assert world.processes.signals == []


def test_a_container_checkpoint_is_not_restored_on_the_node(world: World) -> None:
    """Its images are a plain tree with the container's pids (12, 13): restored by CRIU in
    the daemon's namespaces they would clash with the node's or land outside any container.
    Refused before CRIU runs, the checkpoint kept."""
    _container(world)
    record = world.dump(JOB)
    with pytest.raises(PreconditionFailed) as info:
        world.restore(checkpoint_id=record.id)
    assert "is of a job in a container (pids 12, 13" in str(info.value)
    assert world.criu.restore_jobs == []
    assert [r.id for r in world.store.list()] == [record.id]


def test_reserve_pids_needs_the_callers_process_and_a_sane_number(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    with pytest.raises(InvalidTarget, match="cannot tell the caller"):
        world.service.reserve_pids(Caller(uid=0), 1000)
    with pytest.raises(InvalidTarget, match="cannot reserve pids up to"):
        world.service.reserve_pids(Caller(uid=0, pid=1000), 0)
    assert world.service.reserve_pids(Caller(uid=0, pid=1000), 1000) == 0  # the node's


def test_a_pid_namespace_init_on_the_nodes_root_is_the_job_itself(world: World) -> None:
    """``unshare --fork --pid --mount-proc sh -c 'python ...'``: the init keeps the node's
    root, so it is the job (refused for its mount namespace), not a container whose only
    child would be checkpointed in its place."""
    _container(world)
    world.processes.processes[INIT].own_root = False
    with pytest.raises(TargetRefused, match="mount namespace"):
        world.dump(INIT)
    assert world.criu.dump_jobs == []
