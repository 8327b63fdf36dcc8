"""Restoring into a container (the next pod): the GPU map follows the GPUs that container
sees (``GpuSteps.visible_to``, ``plan_restore(visible=...)``), or the restore is refused
naming what is missing. Driven by ``FakeGpu``."""

from __future__ import annotations

import pytest

from ckptd.core.compat import gpu_problems
from ckptd.core.gpu import GpuSteps
from ckptd.domain import CheckpointRecord, GpuFacts, GpuInfo, GpuUse
from ckptd.errors import GpuMismatch, GpuUnavailable
from ckptd.testing import FakeClock, FakeGpu, FakeProcessTable

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30
CALLER = 4100  # the restoring process, in the new pod


def gpu(i: int, name: str = H100) -> GpuInfo:
    return GpuInfo(i, name, f"GPU-{i:08d}-0000-0000-0000-000000000000", 80 * GIB, 80 * GIB)


def facts(
    *gpus: GpuInfo, need: int = 10 * GIB, on: tuple[GpuInfo, ...] | None = None
) -> GpuFacts:
    """``gpus`` used, on a node of the GPUs ``on`` (default: just those)."""
    return GpuFacts(
        driver_version="580.159.03",
        cuda_version=13000,
        gpus=gpus,
        uses=tuple(GpuUse(4242, g.uuid, need) for g in gpus),
        cuda_pids=(4242,),
        node_gpus=on if on is not None else gpus,
    )


def node(*gpus: GpuInfo) -> tuple[FakeGpu, GpuSteps]:
    fake = FakeGpu(list(gpus))
    return fake, GpuSteps(fake, fake, FakeClock(), 1000)


def sees(fake: FakeGpu, steps: GpuSteps, *gpus: GpuInfo) -> tuple[str, ...] | None:
    fake.set_visible(CALLER, [g.uuid for g in gpus])
    return steps.visible_to(CALLER)


# ---- the automatic choice --------------------------------------------------------------------


def test_two_gpus_go_to_the_two_other_gpus_the_container_sees() -> None:
    old = (gpu(0), gpu(1))  # the old pod's GPUs: still on this node, but not the new pod's
    fake, steps = node(gpu(0), gpu(1), gpu(2), gpu(3))
    visible = sees(fake, steps, gpu(2), gpu(3))
    assert visible == (gpu(2).uuid, gpu(3).uuid)
    on = (gpu(0), gpu(1), gpu(2), gpu(3))
    assert steps.plan_restore(facts(*old, on=on), visible=visible) == {
        gpu(0).uuid: gpu(2).uuid,
        gpu(1).uuid: gpu(3).uuid,
        gpu(2).uuid: gpu(0).uuid,  # the GPUs the job did not use: a pair each, as well
        gpu(3).uuid: gpu(1).uuid,
    }
    assert steps.plan_restore(facts(*old, on=on)) is None, "without a container: the same GPUs"


def test_gpus_of_another_node_go_to_the_visible_ones_only() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2), gpu(3))
    visible = sees(fake, steps, gpu(3), gpu(1))
    on = (gpu(7), gpu(8), gpu(9), gpu(10))
    plan = steps.plan_restore(facts(gpu(7), gpu(8), on=on), visible=visible)
    assert plan == {
        gpu(7).uuid: gpu(1).uuid,
        gpu(8).uuid: gpu(3).uuid,
        gpu(9).uuid: gpu(0).uuid,
        gpu(10).uuid: gpu(2).uuid,
    }


def test_the_same_gpus_visible_need_no_map() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    visible = sees(fake, steps, gpu(0), gpu(1))
    on = (gpu(0), gpu(1), gpu(2))
    assert steps.plan_restore(facts(gpu(0), gpu(1), on=on), visible=visible) is None


def test_one_old_gpu_visible_stays_and_the_other_moves() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    visible = sees(fake, steps, gpu(1), gpu(2))
    plan = steps.plan_restore(facts(gpu(0), gpu(1), on=(gpu(0), gpu(1), gpu(2))),
                              visible=visible)
    assert plan == {gpu(0).uuid: gpu(2).uuid, gpu(1).uuid: gpu(1).uuid,
                    gpu(2).uuid: gpu(0).uuid}


def test_a_container_seeing_one_gpu_is_refused_naming_both() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2), gpu(3))
    visible = sees(fake, steps, gpu(2))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts(gpu(0), gpu(1)), visible=visible)
    (line,) = info.value.problems
    assert f"needs 2 {H100} GPUs ({gpu(0).uuid}, {gpu(1).uuid})" in line
    assert f"the container sees 1 of this model: {gpu(2).uuid} (GPU 2)" in line
    assert "give the container 2 of this node's 4" in line
    assert line in str(info.value)


def test_a_container_seeing_no_gpu_is_refused() -> None:
    fake, steps = node(gpu(0), gpu(1))
    visible = sees(fake, steps)
    assert visible == ()
    with pytest.raises(GpuMismatch, match=r"sees none of this model \(it sees no GPU at all\)"):
        steps.plan_restore(facts(gpu(0)), visible=visible)


def test_too_few_on_the_node_says_to_restore_elsewhere() -> None:
    fake, steps = node(gpu(0), gpu(1, A100))
    visible = sees(fake, steps, gpu(0), gpu(1, A100))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts(gpu(7), gpu(8)), visible=visible)
    assert "this node has only 1: restore on a node with 2" in str(info.value)


def test_another_model_visible_is_named() -> None:
    fake, steps = node(gpu(0), gpu(1, A100))
    visible = sees(fake, steps, gpu(1, A100))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts(gpu(7)), visible=visible)
    assert f"sees none of this model (it sees {A100} x1)" in str(info.value)


def test_a_visible_gpu_without_free_memory_is_named() -> None:
    fake, steps = node(gpu(0), gpu(1))
    fake.add_cuda_process(5000, 75 * GIB, gpus=[gpu(1).uuid])  # another job holds GPU 1
    visible = sees(fake, steps, gpu(1))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts(gpu(7)), visible=visible)
    assert f"{gpu(1).uuid} (GPU 1, 5120 MiB free of 10240 needed)" in str(info.value)


# ---- --gpu-map -------------------------------------------------------------------------------


def test_a_map_target_the_container_does_not_see_is_refused() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    visible = sees(fake, steps, gpu(2))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts(gpu(0)), {gpu(0).uuid: gpu(1).uuid}, visible)
    (line,) = info.value.problems
    assert line == (
        f"--gpu-map target {gpu(1).uuid} (GPU 1) is not visible in the container (it sees "
        f"{gpu(2).uuid}): map onto a GPU it sees, or give the container that GPU"
    )


def test_a_map_onto_visible_gpus_is_used() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    visible = sees(fake, steps, gpu(2))
    on = (gpu(0), gpu(1), gpu(2))
    plan = steps.plan_restore(facts(gpu(0), on=on), {gpu(0).uuid: gpu(2).uuid}, visible)
    assert plan == {gpu(0).uuid: gpu(2).uuid, gpu(1).uuid: gpu(1).uuid,
                    gpu(2).uuid: gpu(0).uuid}


def test_every_problem_of_a_map_is_listed() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    visible = sees(fake, steps)
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(
            facts(gpu(0), gpu(1)), {gpu(0).uuid: gpu(1).uuid, gpu(1).uuid: "GPU-nope"}, visible
        )
    assert len(info.value.problems) == 2
    assert "(it sees no GPU)" in info.value.problems[0]
    assert "GPU-nope is not a GPU of this node" in info.value.problems[1]


# ---- GpuSteps.visible_to and gpu_problems ---------------------------------------------------


def test_nothing_restricts_a_process_by_default() -> None:
    fake, steps = node(gpu(0))
    assert steps.visible_to(CALLER) is None
    assert fake.visible_calls == [CALLER]


def test_no_gpu_support_restricts_nothing() -> None:
    assert GpuSteps(None, None, FakeClock(), 1000).visible_to(CALLER) is None


def test_a_caller_that_is_gone_cannot_be_inspected() -> None:
    fake = FakeGpu([gpu(0)], processes=FakeProcessTable())
    steps = GpuSteps(fake, fake, FakeClock(), 1000)
    with pytest.raises(GpuUnavailable, match=f"pid {CALLER}"):
        steps.visible_to(CALLER)


def test_gpu_problems_pass_the_visible_gpus_on() -> None:
    fake, steps = node(gpu(0), gpu(1), gpu(2))
    record = CheckpointRecord("ck-1", 4242, 0.0, "node-a", 0,
                              gpu=facts(gpu(0), gpu(1), on=(gpu(0), gpu(1), gpu(2))))
    assert gpu_problems(record, steps, None) == []
    visible = sees(fake, steps, gpu(2))
    (line,) = gpu_problems(record, steps, None, visible)
    assert "the container sees 1 of this model" in line
    (line,) = gpu_problems(record, steps, {gpu(0).uuid: gpu(1).uuid}, (gpu(1).uuid,))
    assert f"does not name checkpointed GPU {gpu(1).uuid}" in line
