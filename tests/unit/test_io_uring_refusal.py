"""A tree that holds an io_uring instance is refused before anything is touched, in one line
naming the process and the way out (over the fakes)."""

from __future__ import annotations

import pytest

from ckptd.domain.model import ROOT
from ckptd.errors import PermissionDenied, TargetRefused

from .world import JOB, JOB_TREE, OTHER, OTHER_JOB, USER, World, assert_nothing_happened

WAY_OUT = (
    "launch it through `ckptctl run` (which keeps io_uring away from jobs), or turn the "
    "library's io_uring use off (e.g. PyTorch: USE_LIBUV=0 for init_method=env:// ranks)"
)


def refusal(world: World, pid: int = JOB) -> str:
    with pytest.raises(TargetRefused) as info:
        world.dump(pid, USER if pid == JOB else ROOT)
    assert info.value.pid == pid
    assert info.value.hint == WAY_OUT
    assert_nothing_happened(world)
    assert world.states(*JOB_TREE) == ["running"] * 3
    line = str(info.value)
    assert "\n" not in line
    return line


def test_the_root_holding_an_io_uring_is_named_with_the_way_out(world: World) -> None:
    world.processes.processes[JOB].io_uring = True
    assert refusal(world) == (
        f"pid {JOB} (job) holds an io_uring instance, which CRIU cannot checkpoint; {WAY_OUT}"
    )


def test_a_descendant_holding_an_io_uring_is_named(world: World) -> None:
    world.processes.processes[1002].io_uring = True
    assert refusal(world).startswith(
        f"process 1002 (job-child) in the tree of pid {JOB} holds an io_uring instance, "
        "which CRIU cannot checkpoint; launch it through `ckptctl run`"
    )


def test_every_holder_is_named_up_to_four(world: World) -> None:
    for pid in JOB_TREE:
        world.processes.processes[pid].io_uring = True
    assert refusal(world).startswith(
        f"pid {JOB} (job) holds an io_uring instance (so do 1001 (job-child), 1002 "
        "(job-child)), which"
    )
    for pid in range(1003, 1007):
        world.processes.add_process(pid, JOB, comm="rank", uid=USER.uid, io_uring=True)
    assert "(so do 1001 (job-child), 1002 (job-child), 1003 (rank), 3 more)" in refusal(world)


def test_a_caller_not_allowed_learns_nothing_of_io_uring(world: World) -> None:
    """Permission is checked first: the refusal names other users' processes only to root."""
    world.processes.processes[OTHER_JOB].io_uring = True
    with pytest.raises(PermissionDenied):
        world.dump(OTHER_JOB, USER)
    with pytest.raises(TargetRefused):
        world.dump(OTHER_JOB, OTHER)


def test_once_the_io_uring_is_gone_the_tree_is_dumped(world: World) -> None:
    proc = world.processes.processes[1001]
    proc.io_uring = True
    refusal(world)
    proc.io_uring = False
    record = world.dump(JOB, USER, leave_running=True)
    assert [p.pid for p in record.processes] == list(JOB_TREE)


def test_a_zombie_in_the_tree_holds_no_io_uring(world: World) -> None:
    world.processes.kill_mode = "zombie"
    proc = world.processes.processes[1002]
    proc.io_uring = True
    world.processes.terminate(1002)
    tree = world.processes.tree(JOB)
    assert world.processes.io_uring_holders(tree) == ()
