"""CUDA processes in the dump and restore recipes, over the ``GpuCheckpointer`` port.

Dump: every CUDA process of the tree is locked, then checkpointed (device memory moved into
its host memory) — all of them before CRIU seizes any process — and CRIU dumps host memory
only. Restore: CRIU recreates the tree (CUDA still checkpointed), then each process is restored
onto this node's GPUs (remapped by UUID when they differ) and unlocked.

Invariants: undo steps look at the driver's current state and only move a process back
towards RUNNING (restore if CHECKPOINTED, unlock if LOCKED), so they are safe to run after a
partial step, twice, or after a later step already resumed the process; the driver's restore
thread is never frozen during a CUDA call, and, with a ``ThreadHold``, nothing else of the
process runs before its CUDA state is back (every other thread held: docs/adr/0019); a
record's ``GpuFacts.node_gpus`` lists every GPU of the dumping node, and a restore onto
other GPUs passes the driver a pair for each of them (``ckptd.core.gpu_plan``) — for each
GPU the job could see (``GpuFacts.visible_gpus``) when that was fewer (``gpu_domain``) — after
restore planning checked — before CRIU touches anything — that the node has as many GPUs of
the same models and that the checkpointer can remap at all (``remap_refusal``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from ckptd.core.gpu_domain import cover, partial_refusal, remap_domain
from ckptd.core.gpu_plan import (
    check_gpu_map,
    complete_map,
    match_gpus,
    state_refusals,
    workload_refusals,
)
from ckptd.core.ports import (
    Clock,
    CudaProcessFact,
    CudaProcessFacts,
    GpuCheckpointer,
    GpuInventoryPort,
    ThreadHold,
)
from ckptd.domain import CudaState, GpuFacts, GpuInventory, ProcessFact
from ckptd.errors import GpuFailed, GpuMismatch, GpuUnavailable, PreconditionFailed

__all__ = ["GpuSession", "GpuSteps", "check_gpu_map", "complete_map", "match_gpus"]

log = logging.getLogger(__name__)

MIN_CUDA = 12080  # r570 / CUDA 12.8: the checkpoint API
MIN_CUDA_REMAP = 13000  # r580 / CUDA 13.0: CUcheckpointRestoreArgs.gpuPairs
LOCK_RETRIES = 3  # ILLEGAL_STATE while the target initializes CUDA: retry
NOT_SUPPORTED = "CUDA_ERROR_NOT_SUPPORTED"
NOT_SUPPORTED_MEANS = (
    "the driver does not support checkpointing this process's CUDA use: CUDA IPC memory "
    "shared with another process, UVM (managed) memory, MIG or NCCL across processes "
    "(what ckptd cannot see before the call)"
)
NOT_SUPPORTED_HINT = (
    "CUDA IPC: driver r610 and the job started with cuda-checkpoint --launch-job; MIG: a GPU "
    "with MIG disabled; NCCL: checkpoint at a collective boundary through the framework"
)


@dataclass
class GpuSession:
    """What the GPU steps of one dump did, so undo knows what to take back."""

    cuda_pids: tuple[int, ...] = ()
    locked: list[int] = field(default_factory=list)
    checkpointed: list[int] = field(default_factory=list)
    inventory: GpuInventory | None = None
    visible: tuple[str, ...] = ()
    """UUIDs the CUDA processes could see (union; ``GpuFacts.visible_gpus``); () unknown."""
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
            node_gpus=inv.gpus,
            visible_gpus=self.visible,
        )


class GpuSteps:
    """The GPU part of the recipes. With no GPU support (``gpu`` None) every step is a no-op
    for trees without CUDA, and refuses trees that need it. ``facts``: what /proc says of
    the CUDA processes (NCCL, launch jobs), for the inspect-time refusals of workloads the
    driver cannot checkpoint (``gpu_plan.workload_refusals``); None: not looked at.
    ``threads``: holds the other threads of a process while the driver restores it on its
    restore thread (``resume``); None: nothing held (a process runs whole meanwhile)."""

    def __init__(
        self,
        gpu: GpuCheckpointer | None,
        inventory: GpuInventoryPort | None,
        clock: Clock,
        lock_timeout_ms: int,
        *,
        facts: CudaProcessFacts | None = None,
        threads: ThreadHold | None = None,
    ) -> None:
        if lock_timeout_ms < 0:
            raise ValueError(
                f"lock timeout {lock_timeout_ms} ms: negative (0 means no limit in the driver)"
            )
        self._gpu = gpu
        self._inventory = inventory
        self._clock = clock
        self._lock_timeout_ms = lock_timeout_ms
        self._facts = facts
        self._threads = threads

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

    def inspect(
        self,
        session: GpuSession,
        tree: Sequence[ProcessFact],
        stopped: Set[int] = frozenset(),
    ) -> None:
        """Find the tree's CUDA processes and this node's GPUs. ``stopped``: the pids of the
        tree stopped now (SIGSTOP, a tracer): a CUDA one among them is refused here with
        ``PreconditionFailed`` — the driver cannot lock a process whose threads do not run
        (the lock would only time out). So is a workload the driver cannot checkpoint (NCCL
        across processes, MIG, a launch job below r610: ``gpu_plan.workload_refusals``),
        before anything is frozen."""
        if self._gpu is None:
            return
        session.cuda_pids = tuple(p.pid for p in tree if self._gpu.uses_cuda(p.pid))
        halted = [pid for pid in session.cuda_pids if pid in stopped]
        if halted:
            listed = ", ".join(map(str, halted))
            raise PreconditionFailed(
                f"CUDA process{'es' if len(halted) > 1 else ''} {listed} of the tree "
                f"{'are' if len(halted) > 1 else 'is'} stopped (SIGSTOP or a tracer): the "
                "driver cannot lock a stopped CUDA process",
                hint=f"resume it first (kill -CONT {listed}), then checkpoint",
                pid=halted[0],
            )
        states = {pid: self._gpu.state(pid) for pid in session.cuda_pids}
        refused = state_refusals(states)
        if refused:
            raise PreconditionFailed(
                "cannot checkpoint the tree's CUDA state: " + "; ".join(refused),
                pid=next(p for p in states if states[p] is not CudaState.RUNNING),
            )
        if session.cuda_pids:
            session.inventory = self.node_inventory()
            session.visible = self._seen_by(session.cuda_pids, session.inventory)
            self._refuse_workloads(session.cuda_pids, session.inventory, session.visible)

    def _refuse_workloads(
        self, pids: Sequence[int], inv: GpuInventory, visible: Sequence[str]
    ) -> None:
        """Raise ``PreconditionFailed`` naming every workload of ``pids`` the driver cannot
        checkpoint (``gpu_plan.workload_refusals``)."""
        if self._facts is None:  # MIG is the inventory's: refused still
            facts = [CudaProcessFact(pid) for pid in pids]
        else:
            facts = [self._facts.cuda_facts(pid) for pid in pids]
        for fact in facts:
            if fact.unreadable:
                log.warning("cannot read /proc of CUDA pid %d: %s", fact.pid, fact.unreadable)
        seen = set(visible) or {g.uuid for g in inv.gpus}
        used = {
            pid: {u.uuid for u in inv.uses if u.pid == pid} or seen for pid in pids
        }
        refused = workload_refusals(facts, inv, used)
        if refused:
            raise PreconditionFailed(
                "cannot checkpoint the tree's CUDA processes: " + "; ".join(refused),
                pid=pids[0],
            )

    def _seen_by(self, pids: Sequence[int], inv: GpuInventory) -> tuple[str, ...]:
        """The UUIDs of ``inv``'s GPUs that any of ``pids`` could see (what their CUDA
        could open: a remap names exactly these, ``gpu_domain``), in ``inv`` order; () when
        a pid cannot be inspected (the remap then covers the whole node, as before)."""
        if self._inventory is None or not inv.gpus:
            return ()
        seen: set[str] = set()
        for pid in pids:
            try:
                got = self._inventory.visible_to(pid)
            except GpuUnavailable as exc:
                log.warning("cannot record which GPUs pid %d sees: %s", pid, exc)
                return ()
            seen |= {g.uuid for g in inv.gpus} if got is None else set(got)
        return tuple(g.uuid for g in inv.gpus if g.uuid in seen)

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
                    _translate(exc)
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
            try:
                gpu.checkpoint(pid)
            except GpuFailed as exc:
                _translate(exc)
                raise
        session.timings["checkpoint"] = self._clock.monotonic() - started

    def resume(
        self,
        session: GpuSession,
        gpu_map: Mapping[str, str] | None = None,
        *,
        cont: Callable[[], None] | None = None,
    ) -> None:
        """Restore (if checkpointed) and unlock (if locked) every process, newest first,
        each held (docs/adr/0019): with a ``ThreadHold``, every thread of each process to
        resume but its restore thread is held first, then ``cont()`` (the caller SIGCONTs
        what is stopped of them: only the restore threads can run), then restore + unlock,
        then every hold is released (also on failure). A process that cannot be held is
        not resumed (its failure raised). Raises the first failure after trying every
        process."""
        if self._gpu is None or not (session.locked or session.checkpointed):
            if cont is not None:
                cont()
            return
        first: BaseException | None = None
        t_restore = t_unlock = 0.0
        pids = list(reversed(dict.fromkeys(session.locked + session.checkpointed)))
        held: list[int] = []
        unheld: set[int] = set()
        threads = self._threads
        try:
            if threads is not None:
                # No state query before the hold: the driver answers GetState (and restore,
                # unlock) through the process's restore thread, which is stopped with the rest
                # of the tree here; seen on an H100 (driver 580.159): GetState on a restored,
                # stopped process never answered. GetRestoreThreadId needs no thread of the
                # target (CRIU's cuda_plugin.c resume_device asks it of a stopped task too).
                # Every pid of the session is held; one that is RUNNING after all is left so.
                for pid in pids:
                    try:
                        threads.hold(pid, self._gpu.restore_thread(pid))
                        held.append(pid)
                    except Exception as exc:
                        log.error("could not hold the threads of CUDA pid %d: %s", pid, exc)
                        first = first or exc
                        unheld.add(pid)
            if cont is not None:
                cont()
            t_restore, t_unlock, failed, done = self._restore_unlock(
                [p for p in pids if p not in unheld], gpu_map)
            first = first or failed
            # what is back is off the session: a second resume (a rollback after a failed
            # one, an undo record) neither holds nor asks about a process that runs again
            session.locked[:] = [p for p in session.locked if p not in done]
            session.checkpointed[:] = [p for p in session.checkpointed if p not in done]
        finally:
            for pid in held:
                assert threads is not None
                threads.release(pid)
        session.timings["restore"] = t_restore
        session.timings["unlock"] = t_unlock
        if first is not None:
            raise first

    def _restore_unlock(
        self, pids: Sequence[int], gpu_map: Mapping[str, str] | None
    ) -> tuple[float, float, BaseException | None, set[int]]:
        """Restore and unlock each of ``pids`` as its state needs; the time each took, the
        first failure (every pid tried) and the pids now RUNNING."""
        assert self._gpu is not None
        first: BaseException | None = None
        t_restore = t_unlock = 0.0
        done: set[int] = set()
        for pid in pids:
            try:
                t0 = self._clock.monotonic()
                if self._gpu.state(pid) is CudaState.CHECKPOINTED:
                    self._gpu.restore(pid, gpu_map)
                t1 = self._clock.monotonic()
                if self._gpu.state(pid) is CudaState.LOCKED:
                    self._gpu.unlock(pid)
                t_restore += t1 - t0
                t_unlock += self._clock.monotonic() - t1
                done.add(pid)
            except Exception as exc:
                log.error("could not resume CUDA in pid %d: %s", pid, exc)
                first = first or exc
        return t_restore, t_unlock, first, done

    def _remap_problems(self, facts: GpuFacts, inv: GpuInventory) -> list[str]:
        """Why a restore onto other GPUs cannot be done here, if it cannot: an old record
        (no ``node_gpus``), a driver older than r580, a checkpointer that cannot remap."""
        found: list[str] = []
        if not facts.node_gpus:
            found.append(
                "the checkpoint must go onto other GPUs, but it was written by a ckptd that "
                "recorded only the GPUs the job used, and the driver needs a pair for every "
                "GPU of the dumping node: restore it onto the same GPUs (the node it was "
                "taken on, those GPUs free and visible)"
            )
        if inv.cuda_version and inv.cuda_version < MIN_CUDA_REMAP:
            found.append(
                f"the GPUs differ and driver CUDA {_ver(inv.cuda_version)} cannot remap them "
                "(needs r580 / CUDA 13.0)"
            )
        elif self._gpu is not None:
            refusal = self._gpu.remap_refusal()
            if refusal:
                found.append(f"the GPUs differ and {refusal}")
        return found

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
        visible, else a visible free GPU of the same model. A map that moves anything is
        completed with a pair for every other GPU of the dumping node (identity pairs
        included; ``gpu_plan.complete_map``) and needs as many GPUs here, an r580 driver and
        a checkpointer that can remap; a record without ``node_gpus`` (written before ckptd
        kept them) restores onto the same GPUs only. UUIDs of ``wanted`` may be in any case,
        with or without ``GPU-``. Raises GpuMismatch / GpuUnavailable listing every blocking
        difference."""
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
        # A checkpoint taken below r570 was taken by the cuda-checkpoint --toggle fallback
        # (ckptd.adapters.cuda.binary): restorable by the same fallback on such a driver, so
        # the backend that dumped decides, not this driver's lack of the API.
        toggled = 0 < facts.cuda_version < MIN_CUDA
        if inv.cuda_version and inv.cuda_version < MIN_CUDA and not toggled:
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
        remap = any(old != new for old, new in mapping.items())
        refusal = partial_refusal(facts, inv.driver_version, inv.gpus, visible)
        if refusal:
            problems.append(refusal)
        domain = remap_domain(facts)  # the job saw some of its node's GPUs: those only
        if not problems:  # the job's own GPUs placed: now a pair for every GPU it could see
            if domain is not None and remap:
                opens = [g for g in inv.gpus if visible is None or g.uuid in visible]
                mapping = cover(mapping, domain, opens, problems)
            elif domain is None and facts.node_gpus and (
                remap or len(facts.node_gpus) != len(inv.gpus)
            ):
                mapping = complete_map(mapping, facts.node_gpus, inv.gpus, problems)
            if remap:
                problems.extend(self._remap_problems(facts, inv))
        if problems:
            unique = tuple(dict.fromkeys(problems))
            raise GpuMismatch(
                "this node cannot restore the checkpoint's GPUs: " + "; ".join(unique),
                problems=unique,
            )
        return mapping if remap else None


def _translate(exc: GpuFailed) -> None:
    """Raise, in ``exc``'s place, a ``GpuFailed`` that says what the driver's
    CUDA_ERROR_NOT_SUPPORTED means for a checkpoint and what would work; other errors are
    left as they are."""
    if exc.code != NOT_SUPPORTED:
        return
    raise GpuFailed(
        f"{exc.message} ({NOT_SUPPORTED_MEANS})",
        call=exc.call, code=exc.code, pid=exc.pid, hint=NOT_SUPPORTED_HINT,
    ) from exc


def _ver(cuda: int) -> str:
    return f"{cuda // 1000}.{cuda % 1000 // 10}"
