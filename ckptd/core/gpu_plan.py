"""Restore-time GPU planning, pure: which of this node's GPUs take a checkpoint's.

The driver restores a process's CUDA state onto other GPUs only with a map naming *every*
GPU that was checkpointed — every GPU of the node the kernel-mode driver saw, identity
pairs included, whatever the process used or CUDA_VISIBLE_DEVICES masked — onto as many
distinct GPUs of the same chip. So a plan has two parts: the GPUs the job used go where it
can use them (``match_gpus`` / a caller's map, ``check_gpu_map``), then ``complete_map``
pairs every other GPU of the dumping node with a GPU of this one (itself when present,
else one of the same model). A node with another GPU count cannot take a remap at all.

Invariants: every function appends each blocking difference to ``problems`` (one line each)
rather than stopping at the first; a map returned by ``complete_map`` without problems has
one entry per GPU of the dumping node and its targets are distinct GPUs of this node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from ckptd.core.gpu_domain import pair_the_rest
from ckptd.core.ports import CudaProcessFact
from ckptd.domain import CudaState, GpuFacts, GpuInfo, GpuInventory, GpuUse, normalize_gpu_uuid

LAUNCH_JOB_DRIVER = 610
"""The first driver branch whose checkpoint takes a ``cuda-checkpoint --launch-job`` job
(the mechanism for CUDA IPC; cuda-checkpoint issues 43, 56)."""

NCCL_TODO = (
    "checkpoint at a collective boundary through the framework (e.g. torch.distributed "
    "checkpointing), or run one process per GPU without NCCL"
)


def state_refusals(states: Mapping[int, CudaState]) -> list[str]:
    """Inspect-time: one line per CUDA process whose driver state forbids ckptd's
    lock / checkpoint / undo cycle. The driver's own rules (CRIU plugins/cuda/cuda_plugin.c,
    ``pause_devices``: a FAILED task is "an unrecoverable failed state" and refused; a task
    already LOCKED or CHECKPOINTED by its owner is left so) — ckptd refuses the latter with
    why instead of locking it again (ILLEGAL_STATE three times) and then "undoing" it into
    RUNNING, which would take the owner's lock away."""
    lines: list[str] = []
    for pid, state in states.items():
        if state is CudaState.FAILED:
            lines.append(
                f"pid {pid}: the job's CUDA state is lost (the driver left it FAILED, e.g. "
                "after a failed restore): it cannot be checkpointed; restart the job"
            )
        elif state in (CudaState.LOCKED, CudaState.CHECKPOINTED):
            lines.append(
                f"pid {pid}: its CUDA state is already {state.name} (by its owner or another "
                "checkpointer, not by ckptd): ckptd leaves it as it is; unlock it "
                f"(cuda-checkpoint --toggle or --action restore/unlock --pid {pid}) and retry"
            )
    return lines


def workload_refusals(
    facts: Sequence[CudaProcessFact],
    inv: GpuInventory,
    used: Mapping[int, Set[str]],
) -> list[str]:
    """Inspect-time: one line per workload the driver cannot checkpoint, each naming the
    process(es) and what would work, so it is refused before anything is frozen.

    - NCCL in two or more CUDA processes of the tree (``facts``: the tree's CUDA processes):
      the driver does not support it (cuda-checkpoint issue 30) and once one rank is locked
      the others hang in their collectives; one process with NCCL (a single rank) is let go.
    - MIG mode on a GPU a process uses (``used``: pid -> the UUIDs it uses or, when unknown,
      sees; ``inv.mig_enabled``): not supported by the driver (cuda-checkpoint issue 42).
    - A ``--launch-job`` process (``CUDA_CHECKPOINT_JOB_FILE`` set) on a driver below r610,
      whose checkpoint does not know launch jobs (cuda-checkpoint issues 43, 56).

    CUDA IPC and UVM cannot be seen from outside (``ckptd.adapters.procfs.cudafacts``): they
    are left to the driver's refusal. A fact that could not be read refuses nothing."""
    lines: list[str] = []
    nccl = [f.pid for f in facts if f.nccl]
    if len(nccl) >= 2:
        listed = ", ".join(map(str, nccl))
        lines.append(
            f"pids {listed} are {len(nccl)} CUDA processes of the tree using NCCL (libnccl "
            "mapped): the driver cannot checkpoint NCCL across processes (cuda-checkpoint "
            f"issue 30: once one rank is locked the others hang): {NCCL_TODO}"
        )
    mig = set(inv.mig_enabled)
    by_uuid = inv.by_uuid()
    for f in facts:
        on = [by_uuid[u] for u in sorted(used.get(f.pid, frozenset()) & mig) if u in by_uuid]
        if on:
            gpus = ", ".join(f"GPU {g.index} ({g.uuid})" for g in on)
            lines.append(
                f"pid {f.pid}: uses {gpus} in MIG mode, which the driver cannot checkpoint "
                "(cuda-checkpoint issue 42): run it on a GPU with MIG disabled"
            )
    major = _driver_major(inv.driver_version)
    for f in facts:
        if f.launch_job and major is not None and major < LAUNCH_JOB_DRIVER:
            lines.append(
                f"pid {f.pid}: was started as a cuda-checkpoint launch job "
                f"(CUDA_CHECKPOINT_JOB_FILE={f.launch_job}), which needs driver "
                f"r{LAUNCH_JOB_DRIVER} (this node has {inv.driver_version}): upgrade the "
                f"driver to r{LAUNCH_JOB_DRIVER} or later, or start the job without "
                "--launch-job (and without CUDA IPC)"
            )
    return lines


def _driver_major(version: str) -> int | None:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def match_gpus(
    wanted: Sequence[GpuInfo],
    have: Sequence[GpuInfo],
    uses: Sequence[GpuUse],
    problems: list[str],
    *,
    node: Sequence[GpuInfo] | None = None,
) -> dict[str, str]:
    """Old UUID -> new UUID for every checkpointed GPU: the same GPU when present in
    ``have``, else a free GPU of ``have`` of the same model with enough free memory. Appends
    every blocking difference. ``node``: every GPU of this node, when ``have`` is only those
    the restoring container sees (a shortage is then said per model, naming them)."""
    need = {u.uuid: 0 for u in uses}
    for u in uses:
        need[u.uuid] += u.memory
    by_uuid = {g.uuid: g for g in have if g.uuid}
    mapping: dict[str, str] = {}
    taken: set[str] = set()
    for g in wanted:
        if g.uuid in by_uuid:
            mapping[g.uuid] = g.uuid
            taken.add(g.uuid)
    for g in wanted:
        if g.uuid in mapping:
            continue
        for cand in have:
            if not cand.uuid or cand.uuid in taken or cand.name != g.name:
                continue  # a GPU whose UUID NVML could not read cannot be named to the driver
            if cand.memory_free and cand.memory_free < need.get(g.uuid, 0):
                continue
            mapping[g.uuid] = cand.uuid
            taken.add(cand.uuid)
            break
    missing = [g for g in wanted if g.uuid not in mapping]
    if missing and node is not None:
        problems.extend(_not_visible(wanted, missing, have, node, need))
    elif missing:
        want = _models(wanted)
        got = _models(have) or "no GPU"
        problems.append(f"GPU model or count differs: checkpoint has {want}, this node has {got}")
    for old, new in mapping.items():
        gpu = by_uuid[new]
        if gpu.memory_free and gpu.memory_free < need.get(old, 0):
            problems.append(
                f"GPU {gpu.index} ({gpu.name}) has {gpu.memory_free >> 20} MiB free, the "
                f"checkpoint needs {need.get(old, 0) >> 20} MiB"
            )
    return mapping


def _not_visible(
    wanted: Sequence[GpuInfo],
    missing: Sequence[GpuInfo],
    seen: Sequence[GpuInfo],
    node: Sequence[GpuInfo],
    need: Mapping[str, int],
) -> list[str]:
    """One line per GPU model of ``missing``: how many the checkpoint needs (its UUIDs),
    which of them the container sees (and which of those lack free memory), how many this
    node has, and what to do."""
    lines: list[str] = []
    for model in dict.fromkeys(g.name for g in missing):
        used = [g for g in wanted if g.name == model]
        most = max(need.get(g.uuid, 0) for g in used)
        visible = [g for g in seen if g.name == model]
        on_node = sum(1 for g in node if g.name == model)
        n = len(used)
        head = (
            f"the checkpoint needs {n} {model} GPU{'s' if n != 1 else ''} "
            f"({', '.join(g.uuid for g in used)})"
        )
        if visible:
            short = {g.uuid for g in visible if g.memory_free and g.memory_free < most}
            sees = f"the container sees {len(visible)} of this model: " + ", ".join(
                f"{g.uuid} (GPU {g.index}, {g.memory_free >> 20} MiB free of {most >> 20} needed)"
                if g.uuid in short
                else f"{g.uuid} (GPU {g.index})"
                for g in visible
            )
        else:
            others = _models(seen)
            sees = "the container sees none of this model " + (
                f"(it sees {others})" if others else "(it sees no GPU at all)"
            )
        if on_node >= n:
            todo = f"give the container {n} of this node's {on_node} {model} GPUs"
        else:
            todo = f"this node has only {on_node}: restore on a node with {n}"
        lines.append(f"{head}; {sees}: {todo}")
    return lines


def check_gpu_map(
    wanted: Mapping[str, str],
    facts: GpuFacts,
    have: Sequence[GpuInfo],
    problems: list[str],
    *,
    visible: Sequence[str] | None = None,
) -> dict[str, str]:
    """A caller's map, checked: it names every GPU the checkpoint used, each onto a distinct
    GPU of this node (one the restoring container sees, with ``visible``) of the same model
    with enough free memory. UUIDs are compared normalised (``normalize_gpu_uuid``: any case,
    with or without ``GPU-``); the map returned holds the record's and NVML's spellings."""
    wanted = _normalized(wanted, (*facts.gpus, *facts.node_gpus), have)
    by_uuid = {g.uuid: g for g in have if g.uuid}
    old = {g.uuid: g for g in facts.gpus}
    # NVIDIA's tools want a pair for every GPU of the dumping node (cuda-checkpoint README,
    # --device-map): a map naming the node's other GPUs too is what they ask for, not an error
    node = {g.uuid: g for g in facts.node_gpus if g.uuid and g.uuid not in old}
    need: dict[str, int] = {}
    for u in facts.uses:
        need[u.uuid] = need.get(u.uuid, 0) + u.memory
    for uuid in old:
        if uuid not in wanted:
            problems.append(f"--gpu-map does not name checkpointed GPU {uuid}")
    for src, dst in wanted.items():
        if src not in old and src in node:
            _check_other_pair(src, dst, node[src], by_uuid, visible, problems)
            continue
        if src not in old:
            problems.append(f"--gpu-map names {src}, which the checkpoint did not use")
            continue
        target = by_uuid.get(dst)
        if target is None:
            problems.append(f"--gpu-map target {dst} is not a GPU of this node")
            continue
        if visible is not None and dst not in visible:
            sees = ", ".join(u for u in visible if u in by_uuid) or "no GPU"
            problems.append(
                f"--gpu-map target {dst} (GPU {target.index}) is not visible in the container "
                f"(it sees {sees}): map onto a GPU it sees, or give the container that GPU"
            )
            continue
        if target.name != old[src].name:
            problems.append(
                f"--gpu-map puts {old[src].name} ({src}) onto {target.name} ({dst}): models differ"
            )
        if target.memory_free and target.memory_free < need.get(src, 0):
            problems.append(
                f"GPU {target.index} ({target.name}) has {target.memory_free >> 20} MiB free, "
                f"the checkpoint needs {need.get(src, 0) >> 20} MiB"
            )
    if len(set(wanted.values())) != len(wanted):
        problems.append("--gpu-map puts two GPUs onto one")
    return dict(wanted)


def _check_other_pair(
    src: str,
    dst: str,
    was: GpuInfo,
    by_uuid: Mapping[str, GpuInfo],
    visible: Sequence[str] | None,
    problems: list[str],
) -> None:
    """A pair of ``--gpu-map`` for a GPU of the dumping node the job did not use: onto a
    GPU of this node of the same model (visible or not: the job will not use it)."""
    target = by_uuid.get(dst)
    if target is None:
        problems.append(f"--gpu-map target {dst} is not a GPU of this node")
    elif target.name != was.name:
        problems.append(
            f"--gpu-map puts {was.name} ({src}) onto {target.name} ({dst}): models differ"
        )


def complete_map(
    used: Mapping[str, str],
    dumped: Sequence[GpuInfo],
    have: Sequence[GpuInfo],
    problems: list[str],
) -> dict[str, str]:
    """``used`` (the pairs of the GPUs the job used) extended to every GPU of the dumping
    node (``dumped``, ``GpuFacts.node_gpus``): each other one onto itself when this node
    (``have``) has it and it is not taken, else onto a free GPU of the same model. Appends a
    problem when the counts differ or a GPU finds no partner (an unknown GPU pairs only with
    itself)."""
    full = dict(used)
    if len(dumped) != len(have):
        problems.append(
            f"GPU count differs: the checkpoint was taken on a node of {len(dumped)} GPUs "
            f"({_models(dumped)}), this node has {len(have)} ({_models(have) or 'none'}); "
            "the driver restores onto other GPUs only with a pair for every GPU"
        )
        return full
    return pair_the_rest(full, dumped, have, problems, lambda g: (
        f"no GPU of this node is left for the checkpoint's GPU {g.index} "
        f"({g.name}, {g.uuid or 'UUID unknown'}): every GPU of the dumping node needs "
        "a distinct GPU of the same model here"))


def _normalized(
    wanted: Mapping[str, str], old: Sequence[GpuInfo], new: Sequence[GpuInfo]
) -> dict[str, str]:
    """``wanted`` with each UUID spelled as the record (keys) / NVML (values) spell it, when
    it names one of their GPUs in another spelling; others normalised (they match none)."""
    olds = {normalize_gpu_uuid(g.uuid): g.uuid for g in old}
    news = {normalize_gpu_uuid(g.uuid): g.uuid for g in new if g.uuid}
    out: dict[str, str] = {}
    for src, dst in wanted.items():
        key, value = normalize_gpu_uuid(src), normalize_gpu_uuid(dst)
        out[olds.get(key, key)] = news.get(value, value)
    return out


def _models(gpus: Sequence[GpuInfo]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())
