"""Restore-time GPU planning: which of this node's GPUs take a checkpoint's, or why not."""

from __future__ import annotations

import pytest

from ckptd.core.gpu import GpuSteps, match_gpus
from ckptd.domain import GpuFacts, GpuInfo, GpuInventory, GpuUse
from ckptd.domain.model import UNKNOWN_GPU
from ckptd.errors import GpuMismatch, GpuUnavailable
from ckptd.testing import FakeClock

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30


def gpu(i: int, name: str = H100, free: int = 70 * GIB) -> GpuInfo:
    return GpuInfo(i, name, f"GPU-{i:08d}-0000-0000-0000-000000000000", 80 * GIB, free)


def facts(
    *gpus: GpuInfo,
    need: int = 10 * GIB,
    cuda: int = 13000,
    on: tuple[GpuInfo, ...] | None = None,
) -> GpuFacts:
    """``gpus`` used, on a node of the GPUs ``on`` (default: just those; ``()``: a record
    written before ckptd kept the node's GPUs)."""
    return GpuFacts(
        driver_version="580.1",
        cuda_version=cuda,
        gpus=gpus,
        uses=tuple(GpuUse(4242, g.uuid, need) for g in gpus),
        cuda_pids=(4242,),
        node_gpus=on if on is not None else gpus,
    )


class Inventory:
    def __init__(self, inv: GpuInventory) -> None:
        self.inv = inv

    def inventory(self) -> GpuInventory:
        return self.inv


class NoCalls:
    """A GpuCheckpointer that must not be called while planning."""

    refusal: str | None = None

    def remap_refusal(self) -> str | None:
        return self.refusal

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"planning called {name}")


def steps(*gpus: GpuInfo, cuda: int = 13000, available: bool = True) -> GpuSteps:
    inv = GpuInventory(available, "" if available else "no driver", "580.1", cuda, gpus)
    return GpuSteps(NoCalls(), Inventory(inv), FakeClock(), 1000)  # type: ignore[arg-type]


def test_same_gpus_need_no_map() -> None:
    assert steps(gpu(0), gpu(1)).plan_restore(facts(gpu(0), on=(gpu(0), gpu(1)))) is None


def test_other_gpus_of_the_same_model_are_mapped() -> None:
    old = gpu(7)
    plan = steps(gpu(0), gpu(1)).plan_restore(facts(old, on=(old, gpu(8))))
    assert plan == {old.uuid: gpu(0).uuid, gpu(8).uuid: gpu(1).uuid}


def test_two_gpus_map_to_two_distinct_gpus() -> None:
    a, b = gpu(5), gpu(6)
    plan = steps(gpu(0), gpu(1)).plan_restore(facts(a, b))
    assert plan is not None
    assert sorted(plan) == sorted([a.uuid, b.uuid])
    assert len(set(plan.values())) == 2


def test_another_model_is_refused_with_both_named() -> None:
    with pytest.raises(GpuMismatch) as info:
        steps(gpu(0), gpu(1)).plan_restore(facts(gpu(7, A100), gpu(8, A100)))
    text = str(info.value)
    assert f"checkpoint has {A100} x2" in text
    assert f"this node has {H100} x2" in text


def test_too_few_gpus_is_refused() -> None:
    with pytest.raises(GpuMismatch, match="count differs"):
        steps(gpu(0)).plan_restore(facts(gpu(7), gpu(8)))


def test_not_enough_free_memory_is_refused() -> None:
    with pytest.raises(GpuMismatch, match="count differs"):
        steps(gpu(0, free=2 * GIB)).plan_restore(facts(gpu(7), need=10 * GIB))
    problems: list[str] = []
    same = gpu(0, free=2 * GIB)
    match_gpus([same], [same], [GpuUse(1, same.uuid, 10 * GIB)], problems)
    assert problems and "2048 MiB free" in problems[0] and "10240 MiB" in problems[0]


def test_remapping_needs_r580() -> None:
    with pytest.raises(GpuMismatch, match=r"cannot remap them \(needs r580"):
        steps(gpu(0), cuda=12080).plan_restore(facts(gpu(7)))
    assert steps(gpu(0), cuda=12080).plan_restore(facts(gpu(0))) is None


def test_a_driver_without_the_checkpoint_api_is_refused() -> None:
    with pytest.raises(GpuMismatch, match="lacks the checkpoint API"):
        steps(gpu(0), cuda=12040).plan_restore(facts(gpu(0)))


def test_no_driver_is_refused_with_the_reason() -> None:
    with pytest.raises(GpuUnavailable, match="no driver"):
        steps(gpu(0), available=False).plan_restore(facts(gpu(0)))


def test_no_gpu_support_at_all_is_refused() -> None:
    plain = GpuSteps(None, None, FakeClock(), 1000)
    with pytest.raises(GpuUnavailable, match="no GPU support"):
        plain.plan_restore(facts(gpu(0)))


def test_an_explicit_map_is_checked_and_used() -> None:
    old = gpu(0)
    plan = steps(gpu(0), gpu(1)).plan_restore(facts(old, on=(gpu(0), gpu(1))),
                                              {old.uuid: gpu(1).uuid})
    assert plan == {old.uuid: gpu(1).uuid, gpu(1).uuid: gpu(0).uuid}


def test_an_explicit_map_must_name_every_gpu_and_real_targets() -> None:
    a, b = gpu(0), gpu(1)
    with pytest.raises(GpuMismatch) as info:
        steps(gpu(0), gpu(1)).plan_restore(facts(a, b), {a.uuid: "GPU-nope"})
    text = str(info.value)
    assert f"does not name checkpointed GPU {b.uuid}" in text
    assert "GPU-nope is not a GPU of this node" in text


def test_an_explicit_map_onto_another_model_is_refused() -> None:
    with pytest.raises(GpuMismatch, match="models differ"):
        steps(gpu(0), gpu(1, A100)).plan_restore(facts(gpu(0)), {gpu(0).uuid: gpu(1, A100).uuid})


# ---- issue #15: the driver's whole-node map ---------------------------------------------------


def eight(base: int) -> tuple[GpuInfo, ...]:
    return tuple(gpu(base + i) for i in range(8))


def test_a_job_on_gpu0_of_eight_gets_a_pair_for_every_gpu() -> None:
    dumped, here = eight(10), eight(0)
    plan = steps(*here).plan_restore(facts(dumped[0], on=dumped))
    assert plan is not None and len(plan) == 8
    assert sorted(plan) == sorted(g.uuid for g in dumped)
    assert sorted(plan.values()) == sorted(g.uuid for g in here)
    assert plan[dumped[0].uuid] == here[0].uuid


def test_another_gpu_count_is_refused_even_for_the_same_gpus() -> None:
    dumped = eight(0)
    with pytest.raises(GpuMismatch, match=r"GPU count differs: .* node of 8 GPUs"):
        steps(*dumped[:4]).plan_restore(facts(dumped[0], on=dumped))


def test_a_model_per_slot_must_match() -> None:
    dumped = (gpu(10), gpu(11, A100))
    with pytest.raises(GpuMismatch, match=r"no GPU of this node is left .* GPU 11 \(NVIDIA A100"):
        steps(gpu(0), gpu(1)).plan_restore(facts(gpu(10), on=dumped))


def test_an_old_record_without_the_nodes_gpus_refuses_a_remap_clearly() -> None:
    old = facts(gpu(7), on=())
    with pytest.raises(GpuMismatch) as info:
        steps(gpu(0), gpu(1)).plan_restore(old)
    assert "recorded only the GPUs the job used" in str(info.value)
    assert "restore it onto the same GPUs" in str(info.value)
    assert steps(gpu(7), gpu(8)).plan_restore(facts(gpu(7), on=())) is None, "same GPUs: fine"


def test_a_checkpointer_that_cannot_remap_is_refused_at_planning() -> None:
    plan = steps(gpu(0), gpu(1))
    plan._gpu.refusal = "the cuda-checkpoint fallback does not restore onto other GPUs"  # type: ignore[union-attr]
    with pytest.raises(GpuMismatch, match="the GPUs differ and the cuda-checkpoint fallback"):
        plan.plan_restore(facts(gpu(7), on=(gpu(7), gpu(8))))
    assert plan.plan_restore(facts(gpu(0), on=(gpu(0), gpu(1)))) is None, "no remap: fine"


def test_gpu_map_uuids_are_compared_normalised() -> None:
    old, new = gpu(7), gpu(1)
    shout = new.uuid.upper()  # "GPU-00000001-..." upper-cased
    bare = old.uuid[len("GPU-"):]
    plan = steps(gpu(0), gpu(1)).plan_restore(facts(old, on=(old, gpu(8))), {bare: shout})
    assert plan == {old.uuid: new.uuid, gpu(8).uuid: gpu(0).uuid}


def test_an_unknown_gpu_pairs_only_with_itself() -> None:
    unknown = GpuInfo(1, UNKNOWN_GPU, "", 0)
    with pytest.raises(GpuMismatch, match="UUID unknown"):
        steps(gpu(0), gpu(1)).plan_restore(facts(gpu(7), on=(gpu(7), unknown)))


def test_a_gpu_map_naming_every_gpu_of_the_node_is_accepted() -> None:
    """NVIDIA's tools want a complete map: a pair for the GPUs the job did not use too."""
    dumped, here = eight(10), eight(0)
    wanted = {d.uuid: h.uuid for d, h in zip(dumped, reversed(here), strict=True)}
    plan = steps(*here).plan_restore(facts(dumped[0], on=dumped), wanted)
    assert plan == wanted


def test_a_gpu_map_onto_another_model_for_an_unused_gpu_is_still_refused() -> None:
    dumped = (gpu(10), gpu(11, A100))
    here = (gpu(0), gpu(1))
    wanted = {dumped[0].uuid: here[0].uuid, dumped[1].uuid: here[1].uuid}
    with pytest.raises(GpuMismatch, match="models differ"):
        steps(*here).plan_restore(facts(dumped[0], on=dumped), wanted)


def test_a_gpu_whose_uuid_could_not_be_read_is_no_keyerror() -> None:
    unread = GpuInfo(0, H100, "", 80 * GIB, 70 * GIB)
    with pytest.raises(GpuMismatch, match="GPU model or count differs"):
        steps(unread).plan_restore(facts(gpu(7)))


def test_a_checkpoint_the_toggle_fallback_took_below_r570_restores_there() -> None:
    """Below r570 only cuda-checkpoint --toggle can checkpoint: what it dumped, planning
    lets it restore on such a driver (a checkpoint of the API still needs the API)."""
    assert steps(gpu(0), cuda=12040).plan_restore(facts(gpu(0), cuda=12040)) is None
    with pytest.raises(GpuMismatch, match="lacks the checkpoint API"):
        steps(gpu(0), cuda=12040).plan_restore(facts(gpu(0)))
