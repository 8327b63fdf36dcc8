"""CUDA processes in the dump and restore recipes, over the ``GpuCheckpointer`` port.

Dump: every CUDA process of the tree is locked, then checkpointed (device memory moved into
its host memory) — all of them before CRIU seizes any process — and CRIU dumps host memory
only. Restore: CRIU recreates the tree (CUDA still checkpointed), then each process is restored
onto this node's GPUs (remapped by UUID when they differ) and unlocked.

Invariants: undo steps look at the driver's current state and only move a process back
towards RUNNING (restore if CHECKPOINTED, unlock if LOCKED), so they are safe to run after a
partial step, twice, or after a later step already resumed the process; the driver's restore
thread is never frozen during a CUDA call (the tree is resumed before CUDA is restored).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptd.core.ports import Clock, GpuCheckpointer, GpuInventoryPort
from ckptd.domain import CudaState, GpuFacts, GpuInfo, GpuInventory, GpuUse, ProcessFact
from ckptd.errors import GpuFailed, GpuMismatch, GpuUnavailable

log = logging.getLogger(__name__)

MIN_CUDA = 12080  # r570 / CUDA 12.8: the checkpoint API
MIN_CUDA_REMAP = 13000  # r580 / CUDA 13.0: CUcheckpointRestoreArgs.gpuPairs
LOCK_RETRIES = 3  # ILLEGAL_STATE while the target initializes CUDA: retry


@dataclass
class GpuSession:
    """What the GPU steps of one dump did, so undo knows what to take back."""

    cuda_pids: tuple[int, ...] = ()
    locked: list[int] = field(default_factory=list)
    checkpointed: list[int] = field(default_factory=list)
    inventory: GpuInventory | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def facts(self) -> GpuFacts | None:
        if not self.cuda_pids:
            return None
        inv = self.inventory or GpuInventory(False, "")
        uses = tuple(u for u in inv.uses if u.pid in self.cuda_pids)
        used = {u.uuid for u in uses}
        return GpuFacts(
            driver_version=inv.driver_version,
            cuda_version=inv.cuda_version,
            gpus=tuple(g for g in inv.gpus if g.uuid in used) or inv.gpus,
            uses=uses,
            cuda_pids=self.cuda_pids,
            lock_s=self.timings.get("lock", 0.0),
            checkpoint_s=self.timings.get("checkpoint", 0.0),
            restore_s=self.timings.get("restore", 0.0),
            unlock_s=self.timings.get("unlock", 0.0),
        )


class GpuSteps:
    """The GPU part of the recipes. With no GPU support (``gpu`` None) every step is a no-op
    for trees without CUDA, and refuses trees that need it."""

    def __init__(
        self,
        gpu: GpuCheckpointer | None,
        inventory: GpuInventoryPort | None,
        clock: Clock,
        lock_timeout_ms: int,
    ) -> None:
        self._gpu = gpu
        self._inventory = inventory
        self._clock = clock
        self._lock_timeout_ms = lock_timeout_ms

    def node_inventory(self) -> GpuInventory:
        if self._inventory is None:
            return GpuInventory(False, "GPU support is not configured")
        return self._inventory.inventory()

    def describe_checkpointer(self) -> str:
        """How CUDA processes are checkpointed on this node, or why they cannot be (the
        adapter's ``describe()`` where it has one), for the daemon's log."""
        if self._gpu is None:
            return "GPU support is not configured"
        describe = getattr(self._gpu, "describe", None)
        return str(describe()) if callable(describe) else type(self._gpu).__name__

    # ---- dump ---------------------------------------------------------------------------

    def inspect(self, session: GpuSession, tree: Sequence[ProcessFact]) -> None:
        if self._gpu is None:
            return
        session.cuda_pids = tuple(p.pid for p in tree if self._gpu.uses_cuda(p.pid))
        if session.cuda_pids:
            session.inventory = self.node_inventory()

    def lock(self, session: GpuSession) -> None:
        if not session.cuda_pids:
            return
        gpu = self._need()
        started = self._clock.monotonic()
        for pid in session.cuda_pids:
            session.locked.append(pid)  # before the call: undo checks the state anyway
            for attempt in range(LOCK_RETRIES):
                try:
                    gpu.lock(pid, self._lock_timeout_ms)
                    break
                except GpuFailed as exc:
                    if exc.code != "CUDA_ERROR_ILLEGAL_STATE" or attempt == LOCK_RETRIES - 1:
                        raise
                    self._clock.sleep(0.1)
        session.timings["lock"] = self._clock.monotonic() - started

    def checkpoint(self, session: GpuSession) -> None:
        if not session.locked:
            return
        gpu = self._need()
        started = self._clock.monotonic()
        for pid in session.locked:
            session.checkpointed.append(pid)
            gpu.checkpoint(pid)
        session.timings["checkpoint"] = self._clock.monotonic() - started

    def resume(self, session: GpuSession, gpu_map: Mapping[str, str] | None = None) -> None:
        """Restore (if checkpointed) and unlock (if locked) every process, newest first.
        Raises the first failure after trying every process."""
        if self._gpu is None or not (session.locked or session.checkpointed):
            return
        first: BaseException | None = None
        t_restore = t_unlock = 0.0
        for pid in reversed(dict.fromkeys(session.locked + session.checkpointed)):
            try:
                t0 = self._clock.monotonic()
                if self._gpu.state(pid) is CudaState.CHECKPOINTED:
                    self._gpu.restore(pid, gpu_map)
                t1 = self._clock.monotonic()
                if self._gpu.state(pid) is CudaState.LOCKED:
                    self._gpu.unlock(pid)
                t_restore += t1 - t0
                t_unlock += self._clock.monotonic() - t1
            except Exception as exc:
                log.error("could not resume CUDA in pid %d: %s", pid, exc)
                first = first or exc
        session.timings["restore"] = t_restore
        session.timings["unlock"] = t_unlock
        if first is not None:
            raise first

    def _need(self) -> GpuCheckpointer:
        if self._gpu is None:
            raise GpuUnavailable(
                "the tree uses CUDA but this daemon has no GPU support",
                hint="install ckptd[gpu] and an NVIDIA driver >= r570 (CUDA 12.8)",
            )
        return self._gpu

    # ---- restore ------------------------------------------------------------------------

    def visible_to(self, pid: int) -> tuple[str, ...] | None:
        """The UUIDs of this node's GPUs that ``pid`` (the restoring container's process) can
        use, for ``plan_restore``'s ``visible``; None when nothing restricts it, and with no
        GPU support (``plan_restore`` refuses CUDA checkpoints then anyway). Raises
        ``GpuUnavailable`` when ``pid`` cannot be inspected."""
        if self._gpu is None or self._inventory is None:
            return None
        return self._inventory.visible_to(pid)

    def plan_restore(
        self,
        facts: GpuFacts,
        wanted: Mapping[str, str] | None = None,
        visible: Sequence[str] | None = None,
    ) -> dict[str, str] | None:
        """Check that this node can take ``facts``' GPUs; the UUID map to use (None: same
        GPUs). ``wanted`` is the caller's choice (old UUID -> new UUID). ``visible``: the
        UUIDs the restoring container sees (``visible_to``; None: every GPU of the node):
        every target of the map is then one of them — the same GPU only where it is
        visible, else a visible free GPU of the same model. Raises GpuMismatch /
        GpuUnavailable listing every blocking difference."""
        if self._gpu is None:
            raise GpuUnavailable(
                f"the checkpoint holds CUDA processes {list(facts.cuda_pids)} but this daemon "
                "has no GPU support",
                hint="install ckptd[gpu] and an NVIDIA driver >= r570 (CUDA 12.8)",
            )
        inv = self.node_inventory()
        if not inv.available:
            raise GpuUnavailable(f"the checkpoint needs GPUs: {inv.message}")
        problems: list[str] = []
        if inv.cuda_version and inv.cuda_version < MIN_CUDA:
            problems.append(
                f"driver CUDA {_ver(inv.cuda_version)} lacks the checkpoint API (needs 12.8)"
            )
        if wanted:
            mapping = check_gpu_map(wanted, facts, inv.gpus, problems, visible=visible)
        elif visible is None:
            mapping = match_gpus(facts.gpus, inv.gpus, facts.uses, problems)
        else:
            seen = set(visible)
            have = [g for g in inv.gpus if g.uuid in seen]
            mapping = match_gpus(facts.gpus, have, facts.uses, problems, node=inv.gpus)
        remap = {old: new for old, new in mapping.items() if old != new}
        if remap and inv.cuda_version and inv.cuda_version < MIN_CUDA_REMAP:
            problems.append(
                f"the GPUs differ and driver CUDA {_ver(inv.cuda_version)} cannot remap them "
                "(needs r580 / CUDA 13.0)"
            )
        if problems:
            raise GpuMismatch(
                "this node cannot restore the checkpoint's GPUs: " + "; ".join(problems),
                problems=tuple(problems),
            )
        return mapping if remap else None


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
    by_uuid = {g.uuid: g for g in have}
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
            if cand.uuid in taken or cand.name != g.name:
                continue
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
    """A caller's map, checked: it names every checkpointed GPU, each onto a distinct GPU of
    this node (one the restoring container sees, with ``visible``) of the same model with
    enough free memory."""
    by_uuid = {g.uuid: g for g in have}
    old = {g.uuid: g for g in facts.gpus}
    need: dict[str, int] = {}
    for u in facts.uses:
        need[u.uuid] = need.get(u.uuid, 0) + u.memory
    for uuid in old:
        if uuid not in wanted:
            problems.append(f"--gpu-map does not name checkpointed GPU {uuid}")
    for src, dst in wanted.items():
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


def _models(gpus: Sequence[GpuInfo]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def _ver(cuda: int) -> str:
    return f"{cuda // 1000}.{cuda % 1000 // 10}"
