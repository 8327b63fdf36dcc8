"""Which GPUs a restore's remap must cover, and when partial passthrough is refused; pure.

The driver's rule (``cuCheckpointProcessRestore``, CUDA driver API, and NVIDIA's
cuda-checkpoint notes for r575+): a restore given GPU UUID pairs needs a pair for *every GPU
that was checkpointed* — every GPU the process's CUDA could see where it was dumped — each
onto a distinct GPU of the same chip that the restored process can open. So the remap covers
the GPUs the job could see (``GpuFacts.visible_gpus``, recorded at dump from its container's
``/dev/nvidia<N>`` nodes and its ``NVIDIA_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``:
``ckptd.adapters.nvml.visibility``), never the dumping node's whole list: a job in a
container that saw 1 of 8 GPUs gets one pair, aimed at a GPU the restoring container sees.
CRIU's CUDA plugin does the same where it runs (``plugins/cuda/cuda_device_map.c`` records
the UUIDs ``cuDeviceGetCount`` enumerates in the dump's place). Whether a
``CUDA_VISIBLE_DEVICES`` subset narrows what the driver checkpointed is for the hardware
check to confirm (docs/design/gpu-remap.md).

A record without ``visible_gpus`` (written before ckptd recorded them), or one whose job saw
every GPU of its node, is covered over ``node_gpus`` as before (``gpu_plan.complete_map``).

Partial passthrough — the job saw fewer GPUs than its node had, or the restoring container
sees fewer than this node has — fails in drivers before 575.57.08 (NVIDIA/cuda-checkpoint
issues 12 and 24; fixed in the 575.57.08 release notes), so such a restore is refused there.

Invariants: ``cover`` appends one problem per GPU it cannot place and returns a map whose
targets are distinct; ``partial_refusal`` is one line or None.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from ckptd.domain import GpuFacts, GpuInfo
from ckptd.domain.model import UNKNOWN_GPU

MIN_DRIVER_PARTIAL = (575, 57, 8)
"""The first driver that checkpoints and restores a process seeing a subset of the node's
GPUs (a container given some of them)."""


def remap_domain(facts: GpuFacts) -> tuple[GpuInfo, ...] | None:
    """The dumping node's GPUs a remap must name, when the job saw only some of them
    (``visible_gpus`` a strict subset of ``node_gpus``), in ``node_gpus`` order; None when
    the whole node is the domain (nothing recorded, or the job saw every GPU)."""
    if not facts.visible_gpus or not facts.node_gpus:
        return None
    seen = set(facts.visible_gpus)
    domain = tuple(g for g in facts.node_gpus if g.uuid in seen)
    if len(domain) == len(facts.node_gpus):
        return None
    return domain


def cover(
    used: Mapping[str, str],
    domain: Sequence[GpuInfo],
    have: Sequence[GpuInfo],
    problems: list[str],
) -> dict[str, str]:
    """``used`` (the pairs of the GPUs the job used) extended to every GPU of ``domain``
    (the GPUs the job could see): each other one onto itself when ``have`` (the GPUs the
    restoring process can open) has it free, else onto a free GPU of ``have`` of the same
    model. Appends a problem for each GPU with no partner. Unlike a whole-node map, the
    counts need not match: the pairs name the job's GPUs only — a pair of ``used`` for a GPU
    outside ``domain`` (a ``--gpu-map`` naming the whole dumping node) is dropped."""
    inside = {g.uuid for g in domain}
    full = {old: new for old, new in used.items() if old in inside}
    return pair_the_rest(full, domain, have, problems, lambda g: (
        f"no GPU the restoring process sees is left for GPU {g.index} ({g.name}, "
        f"{g.uuid or 'UUID unknown'}), which the job could see when dumped: every GPU "
        "it could see needs a distinct visible GPU of the same model here"))


def pair_the_rest(
    full: dict[str, str],
    gpus: Sequence[GpuInfo],
    have: Sequence[GpuInfo],
    problems: list[str],
    no_partner: Callable[[GpuInfo], str],
) -> dict[str, str]:
    """``full`` (pairs already chosen) extended to every GPU of ``gpus``: each onto itself
    when ``have`` has it and it is not taken, else onto a free GPU of ``have`` of the same
    (known) model; a GPU left without one appends ``no_partner(gpu)`` to ``problems``.
    Returns ``full``, updated in place."""
    here = {g.uuid for g in have if g.uuid}
    taken = set(full.values())
    for g in gpus:
        if g.uuid not in full and g.uuid in here and g.uuid not in taken:
            full[g.uuid] = g.uuid
            taken.add(g.uuid)
    for g in gpus:
        if g.uuid in full:
            continue
        partner = next(
            (c for c in have if c.uuid and c.uuid not in taken and c.name == g.name
             and g.name != UNKNOWN_GPU),
            None,
        )
        if partner is None:
            problems.append(no_partner(g))
            continue
        full[g.uuid] = partner.uuid
        taken.add(partner.uuid)
    return full


def driver_tuple(version: str) -> tuple[int, ...] | None:
    """``"575.57.08"`` -> (575, 57, 8); None when it is not dotted numbers."""
    if not re.fullmatch(r"\d+(\.\d+)*", version.strip()):
        return None
    return tuple(int(p) for p in version.strip().split("."))


def partial_refusal(
    facts: GpuFacts,
    driver_version: str,
    node: Sequence[GpuInfo],
    visible: Sequence[str] | None,
) -> str | None:
    """Why a driver before 575.57.08 cannot restore this checkpoint here, or None: the job
    saw fewer GPUs than its node had (``visible_gpus``), or the restoring process sees fewer
    of this node's GPUs (``node``) than there are (``visible``). An unreadable driver version
    refuses nothing (the driver then answers for itself)."""
    have = driver_tuple(driver_version)
    if have is None or have >= MIN_DRIVER_PARTIAL:
        return None
    why: list[str] = []
    saw = set(facts.visible_gpus)
    if saw and facts.node_gpus and len(saw) < len(facts.node_gpus):
        why.append(f"the job saw {len(saw)} of its node's {len(facts.node_gpus)} GPUs")
    if visible is not None:
        here = {g.uuid for g in node if g.uuid}
        sees = len(here & set(visible))
        if sees < len(here):
            why.append(f"the restoring container sees {sees} of this node's {len(here)} GPUs")
    if not why:
        return None
    least = ".".join(f"{p:02d}" if i else str(p) for i, p in enumerate(MIN_DRIVER_PARTIAL))
    return (
        f"driver {driver_version.strip()} cannot restore CUDA with partial GPU passthrough "
        f"({' and '.join(why)}): give the container every GPU of the node (whole-node "
        f"passthrough) or upgrade the driver to {least} or newer"
    )
