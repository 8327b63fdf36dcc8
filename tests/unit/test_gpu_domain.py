"""Which GPUs a restore's remap covers (issue 23, point 7): the GPUs the job's CUDA could see
where it was dumped (``GpuFacts.visible_gpus``), never the dumping node's whole list; and a
driver older than 575.57.08 refuses partial passthrough. Driven by ``FakeGpu``."""

from __future__ import annotations

import json

import pytest

from ckptd.core.gpu import GpuSession, GpuSteps
from ckptd.core.gpu_domain import cover, driver_tuple, partial_refusal, remap_domain
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import Manifest
from ckptd.domain import CheckpointRecord, GpuFacts, GpuInfo, GpuUse, ProcessFact
from ckptd.errors import GpuMismatch
from ckptd.testing import FakeClock, FakeGpu, FakeProcessTable

H100 = "NVIDIA H100 80GB HBM3"
GIB = 1 << 30
JOB = 4242  # the CUDA process, in the old pod
CALLER = 4100  # the restoring process, in the new pod


def gpu(i: int, node: int = 0) -> GpuInfo:
    return GpuInfo(i, H100, f"GPU-{node:04d}{i:04d}-0000-0000-0000-000000000000", 80 * GIB,
                   80 * GIB)


def eight(node: int = 0) -> list[GpuInfo]:
    return [gpu(i, node) for i in range(8)]


def steps_on(gpus: list[GpuInfo], **kw: object) -> tuple[FakeGpu, GpuSteps]:
    fake = FakeGpu(gpus, **kw)  # type: ignore[arg-type]
    return fake, GpuSteps(fake, fake, FakeClock(), 1000)


def dump(fake: FakeGpu, steps: GpuSteps, *seen: GpuInfo, on: GpuInfo) -> GpuFacts:
    """Checkpoint JOB holding memory on ``on``, its container seeing ``seen`` (none: every
    GPU): the GpuFacts its record gets."""
    fake.add_cuda_process(JOB, GIB, gpus=[on.uuid])
    if seen:
        fake.set_visible(JOB, [g.uuid for g in seen])
    session = GpuSession()
    steps.inspect(session, [ProcessFact(JOB, 1, "job", ("job",), 1000, 1000)])
    steps.lock(session)
    steps.checkpoint(session)
    facts = session.facts()
    assert facts is not None
    return facts


def test_a_container_that_saw_one_of_eight_gpus_gets_one_pair() -> None:
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, gpu(3), on=gpu(3))
    assert facts.visible_gpus == (gpu(3).uuid,)
    assert len(facts.node_gpus) == 8
    # another node of 8; the new pod was given its GPU 5 only
    fake2, steps2 = steps_on(eight(node=1))
    fake2.set_visible(CALLER, [gpu(5, 1).uuid])
    plan = steps2.plan_restore(facts, visible=steps2.visible_to(CALLER))
    assert plan == {gpu(3).uuid: gpu(5, 1).uuid}, "one pair: the GPU the job could see"
    # the same GPUs of the same node, as the job saw them: no map at all
    fake.set_visible(CALLER, [gpu(3).uuid])
    assert steps.plan_restore(facts, visible=steps.visible_to(CALLER)) is None


def test_a_remap_covers_every_gpu_the_job_saw_and_only_those() -> None:
    """The job saw GPUs 2 and 6 (used 2); the new pod sees 0, 1 and 4 of another node: two
    pairs, onto distinct GPUs the new pod sees."""
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, gpu(2), gpu(6), on=gpu(2))
    assert facts.visible_gpus == (gpu(2).uuid, gpu(6).uuid)
    _, steps2 = steps_on(eight(node=1))
    plan = steps2.plan_restore(facts, visible=(gpu(0, 1).uuid, gpu(1, 1).uuid,
                                               gpu(4, 1).uuid))
    assert plan == {gpu(2).uuid: gpu(0, 1).uuid, gpu(6).uuid: gpu(1, 1).uuid}


def test_a_gpu_map_naming_the_whole_dumping_node_gives_the_driver_one_pair() -> None:
    """``--gpu-map`` may name every GPU of the dumping node (NVIDIA's tools ask for that):
    the job saw one of them, so the driver gets that one pair only."""
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, gpu(3), on=gpu(3))
    _, steps2 = steps_on(eight(node=1))
    wanted = {gpu(i).uuid: gpu((i + 2) % 8, 1).uuid for i in range(8)}
    plan = steps2.plan_restore(facts, wanted, visible=(gpu(5, 1).uuid,))
    assert plan == {gpu(3).uuid: gpu(5, 1).uuid}


def test_a_gpu_the_job_saw_with_no_visible_partner_is_refused() -> None:
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, gpu(2), gpu(6), on=gpu(2))
    _, steps2 = steps_on(eight(node=1))
    with pytest.raises(GpuMismatch) as info:
        steps2.plan_restore(facts, visible=(gpu(0, 1).uuid,))
    assert info.value.problems == (
        f"no GPU the restoring process sees is left for GPU 6 ({H100}, {gpu(6).uuid}), which "
        "the job could see when dumped: every GPU it could see needs a distinct visible GPU "
        "of the same model here",
    )


def test_a_job_that_saw_the_whole_node_still_pairs_every_gpu() -> None:
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, on=gpu(0))
    assert facts.visible_gpus == tuple(g.uuid for g in eight())
    assert remap_domain(facts) is None
    _, steps2 = steps_on(eight(node=1))
    plan = steps2.plan_restore(facts)
    assert plan is not None and len(plan) == 8


# ---- drivers before 575.57.08 ---------------------------------------------------------------


def test_an_old_driver_refuses_a_job_that_saw_part_of_its_node() -> None:
    fake, steps = steps_on(eight(), driver_version="570.124.06", cuda_version=12080)
    facts = dump(fake, steps, gpu(3), on=gpu(3))
    with pytest.raises(GpuMismatch) as info:
        steps.plan_restore(facts)  # even onto the same GPU, the restoring process unrestricted
    assert info.value.problems == (
        "driver 570.124.06 cannot restore CUDA with partial GPU passthrough (the job saw 1 of "
        "its node's 8 GPUs): give the container every GPU of the node (whole-node "
        "passthrough) or upgrade the driver to 575.57.08 or newer",
    )
    assert "\n" not in str(info.value)


def test_an_old_driver_refuses_a_container_that_sees_part_of_the_node() -> None:
    fake, steps = steps_on(eight(), driver_version="575.51.03", cuda_version=12090)
    facts = dump(fake, steps, on=gpu(0))  # the job saw the whole node
    with pytest.raises(GpuMismatch, match=r"driver 575\.51\.03 .*the restoring container "
                       r"sees 1 of this node's 8 GPUs.*575\.57\.08 or newer"):
        steps.plan_restore(facts, visible=(gpu(0).uuid,))
    assert steps.plan_restore(facts) is None, "whole-node passthrough: restored as before"


def test_from_575_57_08_partial_passthrough_is_restored() -> None:
    fake, steps = steps_on(eight(), driver_version="575.57.08", cuda_version=12090)
    facts = dump(fake, steps, gpu(3), on=gpu(3))
    assert steps.plan_restore(facts, visible=(gpu(3).uuid,)) is None
    assert partial_refusal(facts, "580.65.06", eight(), (gpu(3).uuid,)) is None
    assert partial_refusal(facts, "not-a-version", eight(), (gpu(3).uuid,)) is None
    assert driver_tuple("575.57.08") == (575, 57, 8) < (575, 57, 10)


# ---- records ---------------------------------------------------------------------------------


def test_visible_gpus_survive_a_manifest_round_trip() -> None:
    fake, steps = steps_on(eight())
    facts = dump(fake, steps, gpu(1), gpu(4), on=gpu(1))
    assert GpuFacts.from_json(json.loads(json.dumps(facts.to_json()))) == facts
    record = CheckpointRecord(id="ck-1", pid=JOB, created=1.0, node="node-a", uid=1000,
                              gpu=facts)
    keys = ManifestKeys.generate()
    raw = Manifest(record=record, uid=1000, files=(), packs=()).to_bytes(keys, "store-1")
    back = Manifest.from_bytes(raw, "ck-1", keys, "store-1").record.gpu
    assert back is not None and back.visible_gpus == (gpu(1).uuid, gpu(4).uuid)


def test_an_old_record_without_visible_gpus_restores_as_before() -> None:
    """A record of a ckptd that did not record ``visible_gpus``: the remap covers every GPU
    of the dumping node (identity pairs included), as before."""
    used = gpu(0)
    old = GpuFacts(driver_version="580.159.03", cuda_version=13000, gpus=(used,),
                   uses=(GpuUse(JOB, used.uuid, GIB),), cuda_pids=(JOB,),
                   node_gpus=tuple(eight())).to_json()
    del old["visible_gpus"]
    facts = GpuFacts.from_json(json.loads(json.dumps(old)))
    assert facts.visible_gpus == ()
    assert remap_domain(facts) is None
    _, steps = steps_on(eight())
    plan = steps.plan_restore(facts, {used.uuid: gpu(1).uuid})
    assert plan is not None and len(plan) == 8 and plan[used.uuid] == gpu(1).uuid
    assert steps.plan_restore(facts) is None


def test_a_job_that_cannot_be_inspected_records_no_visibility() -> None:
    """The CUDA process vanished between finding and asking: nothing recorded, the remap
    then covers the whole node (no refusal of the dump on that account)."""
    fake = FakeGpu(eight(), processes=FakeProcessTable())  # JOB is no process there
    steps = GpuSteps(fake, fake, FakeClock(), 1000)
    inv = fake.inventory()
    assert steps._seen_by((JOB,), inv) == ()


def test_cover_keeps_the_used_pairs_and_gives_distinct_targets() -> None:
    problems: list[str] = []
    full = cover({gpu(0).uuid: gpu(1).uuid}, [gpu(0), gpu(1)], [gpu(0), gpu(1)], problems)
    assert full == {gpu(0).uuid: gpu(1).uuid, gpu(1).uuid: gpu(0).uuid}
    assert problems == []
