"""Issue 23, points 3 and 9: the fake driver charges device memory to the job's memory cgroup
at checkpoint (the real driver copies it into host allocations of the process) and OOM-kills
a job whose cgroup cannot hold it — so the dump's refusal before freezing
(``core.gpumemory.refuse_without_room``) is what stands between a tight cgroup and a job
killed in the middle of its checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.core import gpumemory
from ckptd.domain import CudaState
from ckptd.errors import GpuFailed, TargetRefused
from ckptd.testing import FakeGpu

from .world import JOB, JOB_TREE, World, make_world

GIB = 1 << 30


@pytest.fixture
def gw(tmp_path: Path) -> World:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    world.gpu.add_cuda_process(1000, 3 * GIB)
    world.gpu.add_cuda_process(1002, 1 * GIB)
    for pid in JOB_TREE:
        world.cgroups.place(pid, "/jobs/train")
    return world


def gpu(w: World) -> FakeGpu:
    assert w.gpu is not None
    return w.gpu


def test_without_the_refusal_the_fake_oom_kills_the_job_mid_checkpoint(
        gw: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fix prevents (the old dump): the checkpoint starts, the cgroup overflows,
    the job dies with its CUDA state."""
    monkeypatch.setattr(gpumemory, "refuse_without_room", lambda *_a, **_k: None)
    gw.cgroups.limits["/jobs"] = (4 * GIB, 2 * GIB)
    with pytest.raises(GpuFailed, match="OOM-killed: its cgroup /jobs"):
        gw.dump(JOB, leave_running=True)
    assert gpu(gw).oom_killed == [1000]
    assert gw.states(1000) == ["free"]


def test_the_refusal_comes_before_anything_is_charged(gw: World) -> None:
    gw.cgroups.limits["/jobs"] = (4 * GIB, 2 * GIB)
    with pytest.raises(TargetRefused, match="can hold 2 GiB more"):
        gw.dump(JOB, leave_running=True)
    assert gpu(gw).oom_killed == [] and gw.cgroups.limits["/jobs"] == (4 * GIB, 2 * GIB)
    assert gw.states(*JOB_TREE) == ["running"] * 3


def test_a_cgroup_with_room_is_charged_during_the_checkpoint_and_given_back(gw: World) -> None:
    gw.cgroups.limits["/jobs"] = (16 * GIB, 2 * GIB)
    gw.cgroups.limits["/jobs/train"] = (12 * GIB, 2 * GIB)
    seen: list[tuple[int, int]] = []
    commit = gw.store.commit

    def spying(record):  # type: ignore[no-untyped-def]
        seen.append(gw.cgroups.limits["/jobs"])
        return commit(record)

    gw.store.commit = spying  # type: ignore[method-assign]
    gw.dump(JOB, leave_running=True)
    assert seen == [(16 * GIB, 6 * GIB)]  # 3 + 1 GiB of device memory in host memory
    assert gw.cgroups.limits == {"/jobs": (16 * GIB, 2 * GIB),
                                 "/jobs/train": (12 * GIB, 2 * GIB)}
    assert [gpu(gw).cuda_state(p) for p in (1000, 1002)] == [CudaState.RUNNING] * 2
