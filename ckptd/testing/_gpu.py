"""``FakeGpu``: both GPU ports (``GpuInventoryPort`` and ``GpuCheckpointer``) in memory."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ckptd.core.ports import CudaProcessFact
from ckptd.domain import CudaState, GpuInfo, GpuInventory, GpuUse, PidState
from ckptd.errors import CkptdError, GpuFailed, GpuUnavailable
from ckptd.testing._cgroups import FakeCgroups
from ckptd.testing._clock import FakeClock
from ckptd.testing._processes import FakeProcessTable
from ckptd.testing._threads import FakeThreadHold

if TYPE_CHECKING:
    from ckptd.core.ports import CudaProcessFacts, GpuCheckpointer, GpuInventoryPort

H100 = GpuInfo(
    index=0,
    name="NVIDIA H100 80GB HBM3",
    uuid="GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45",
    memory_total=81559 * 2**20,
    memory_free=81559 * 2**20,
    compute_capability="9.0",
    pci_bus_id="00000000:65:00.0",
)
"""The default GPU of a ``FakeGpu`` (what NVML reports for an H100 SXM)."""

ILLEGAL_STATE = "CUDA_ERROR_ILLEGAL_STATE"
INVALID_VALUE = "CUDA_ERROR_INVALID_VALUE"
OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"
NOT_SUPPORTED = "CUDA_ERROR_NOT_SUPPORTED"

_CALLS = {
    "uses_cuda": "cuCheckpointProcessGetRestoreThreadId",
    "state": "cuCheckpointProcessGetState",
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}
_NEEDS = {
    "lock": CudaState.RUNNING,
    "checkpoint": CudaState.LOCKED,
    "restore": CudaState.CHECKPOINTED,
    "unlock": CudaState.LOCKED,
}
_AFTER = {
    "lock": CudaState.LOCKED,
    "checkpoint": CudaState.CHECKPOINTED,
    "restore": CudaState.LOCKED,
    "unlock": CudaState.RUNNING,
}


NOT_READY = "CUDA_ERROR_NOT_READY"
RESTORE_TID_OFFSET = 1_000_000
"""A fake process's restore thread is its pid plus this (unless ``FakeGpu.restore_tids``)."""


@dataclass
class FakeCudaProcess:
    """A process with a CUDA context: its driver state and device memory per GPU UUID.
    ``checkpointed_on``: while CHECKPOINTED, the node's GPUs (UUID -> model) at the
    checkpoint — what a restore's GPU map must cover, every one of them."""

    pid: int
    memory: dict[str, int] = field(default_factory=dict)
    state: CudaState = CudaState.RUNNING
    checkpointed_on: dict[str, str] = field(default_factory=dict)
    restored: bool = False
    """LOCKED by a ``restore`` (not by a ``lock``): its CUDA state is back only once unlocked."""


class FakeGpu:
    """A ``GpuInventoryPort`` and a ``GpuCheckpointer`` (see ``ckptd.core.ports``) in memory.

    GPUs: ``gpus`` (default: one ``H100``); ``driver_version`` and ``cuda_version`` (13000:
    r580, which can restore onto other GPUs; below 13000 a ``gpu_map`` that moves anything
    raises ``GpuUnavailable``, as the real adapter does). ``add_cuda_process(pid, memory)``
    makes a CUDA process holding ``memory`` bytes on the first GPU (or on ``gpus``).

    State machine, exactly the driver's: RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED
    -restore-> LOCKED -unlock-> RUNNING. Any other transition raises ``GpuFailed`` with code
    ``CUDA_ERROR_ILLEGAL_STATE`` and changes nothing. A CHECKPOINTED process holds no device
    memory: ``inventory()`` lists no use of it and counts its memory as free; ``restore``
    needs that memory free again on the target GPUs (else ``CUDA_ERROR_OUT_OF_MEMORY``).

    Processes: ``uses_cuda`` is True for a CUDA process (whatever its state), False for any
    other pid; other calls on a pid that is not a CUDA process raise ``GpuFailed`` with
    ``CUDA_ERROR_INVALID_VALUE`` (a choice of this fake: the real driver's code is
    unverified). With ``processes``, a pid that is free or a zombie in that table is a
    process that is gone: ``uses_cuda`` is False, other calls raise ``GpuFailed`` with code
    ``NO_SUCH_PROCESS`` (like the real adapter), its memory is not in the inventory, and its
    CUDA state is kept for when a (fake CRIU) restore brings the pid back, as the real state
    lives in the process's memory.

    ``restore(pid, gpu_map)`` follows the driver's documented rules: the process's CUDA
    state goes back onto the GPUs of the node it was checkpointed on (``checkpoint``
    remembers all of them, used or not). Without a map, or with identity pairs only, every
    one of those GPUs must be here, and no other (same GPU count); with a map that moves
    anything, the map must have a pair for EVERY GPU of that node — identity pairs included
    — onto distinct GPUs of this fake of the same model, and this fake must have exactly as
    many GPUs. Anything else raises ``GpuFailed`` with ``CUDA_ERROR_INVALID_VALUE`` and
    changes nothing; the memory moves along the map. ``restore_maps[pid]`` is the map
    passed to the last ``restore`` of ``pid`` (None: none). ``remap_refusal()`` is None from
    CUDA 13.0 on, else the r580 reason; ``remap_refused`` (a message) overrides it, as a
    backend that cannot remap (old bindings, the cuda-checkpoint fallback) says.

    Failure injection (sets of pids, changed freely by a test):

    - ``fail_lock_timeout``: ``lock`` raises ``GpuFailed`` with ``lock_timeout_code``
      (default ``CUDA_ERROR_NOT_READY``, what the driver's documentation gives for a lock
      timeout) and the process stays RUNNING; a negative ``timeout_ms`` is refused
      (``INVALID_TIMEOUT``), as the real adapter does;
    - ``fail_illegal_state_once``: the next ``lock`` raises ``CUDA_ERROR_ILLEGAL_STATE`` (the
      target was in cuInit) and the pid leaves the set, so a retry succeeds;
    - ``fail_checkpoint``, ``fail_restore``, ``fail_unlock``: that call raises ``GpuFailed``
      with ``fail_code`` and the state stays as it was;
    - ``unavailable``: a message (e.g. "driver CUDA 12.4 lacks the checkpoint API: needs r570
      / CUDA 12.8", or missing driver symbols): ``inventory()`` is ``available=False`` with
      it, every call raises ``GpuUnavailable`` with it, except ``uses_cuda`` of a process
      that holds no GPU (not a CUDA process, or one CHECKPOINTED), which is False, as the
      real adapter says for a process with no ``/dev/nvidia*`` mapped.

    Visibility (``visible_to``): ``visible[pid]`` is what ``pid`` sees — a tuple of UUIDs, as
    the devices of its container would give, or None (nothing restricts it); a pid not there
    sees every GPU (None). ``set_visible(pid, uuids)`` checks the UUIDs. UUIDs not among
    ``gpus`` (any, while ``unavailable``) are left out of the answer, as the real adapter
    only knows NVML's GPUs. With ``processes``, a pid that is free or a zombie raises
    ``GpuUnavailable`` (the real adapter cannot read its /proc).

    The restore thread (docs/adr/0019): ``restore_thread(pid)`` is ``restore_tids[pid]``
    (default ``pid + RESTORE_TID_OFFSET``). The driver restores and unlocks on that thread:
    CRIU's CUDA plugin keeps the restored process frozen but lets that one thread run
    (ptrace) before it asks for a restore or an unlock (criu plugins/cuda/cuda_plugin.c,
    ``resume_device``: "wakeup the restore thread so we can handle the restore for this
    pid"). So, with ``processes``, ``restore`` and ``unlock`` of a pid whose restore thread
    cannot run — the pid STOPPED there (SIGSTOP, or CRIU's ``leave_stopped``), or (with
    ``threads``) its restore thread held — raise ``GpuFailed`` with ``CUDA_ERROR_NOT_READY``,
    change nothing and are recorded in ``while_stopped`` (the real call blocks until ckptd's
    bound on it, docs/adr/0015, gives up; this fake fails at once). With ``threads`` (a
    ``FakeThreadHold``), they also fail, recorded in ``while_unheld``, unless every other
    thread of the pid is held (``threads.held[pid]`` is its restore thread): the other
    threads must not run before the CUDA state is back ("attempting to access a UVM pointer
    will crash if we haven't restored the underlying mappings yet"). Codes: this fake's.
    With ``processes``, the fake also watches the process table (``watchers``): a CUDA
    process that goes RUNNING while CHECKPOINTED, or LOCKED by a restore not yet unlocked,
    with its other threads not held (``threads.held[pid]`` its restore thread; with no
    ``threads``, never held) has run its own code before its CUDA state was back — the
    moment CRIU's plugin keeps frozen: its pid is appended to ``ran_unrestored`` (and, with
    ``events``, ``"gpu.ran-unrestored <pid>"``).

    Workloads the driver cannot checkpoint (issue 23, 6), and what /proc shows of them
    (``cuda_facts``, the ``CudaProcessFacts`` port):

    - ``nccl``: pids that map libnccl — the ranks of one NCCL job. While one of them (alive)
      is LOCKED or CHECKPOINTED, ``lock`` of another waits for a collective that never ends
      (cuda-checkpoint issue 30: "once one rank is locked, the other hangs"): it raises
      ``GpuFailed`` with ``lock_timeout_code`` when given a timeout, else with ``TIMEOUT``
      (the adapter's bound on the call, docs/adr/0015), advancing the clock by ``hang_s``,
      and the pid is recorded in ``hung``; the process stays RUNNING;
    - ``mig``: UUIDs of GPUs in MIG mode (``inventory().mig_enabled``); ``lock`` of a process
      holding memory on one raises ``CUDA_ERROR_NOT_SUPPORTED`` (cuda-checkpoint issue 42);
    - ``ipc``: pids that share device memory through CUDA IPC, invisible in /proc;
      ``checkpoint`` of one raises ``CUDA_ERROR_NOT_SUPPORTED`` unless it is a launch job
      on r610 or later (cuda-checkpoint issues 43, 56);
    - ``launch_jobs``: pid -> its ``CUDA_CHECKPOINT_JOB_FILE`` (started with
      ``cuda-checkpoint --launch-job``).

    The codes of the MIG and IPC refusals are choices of this fake (the driver's are
    unverified). ``cuda_facts`` of a pid that is gone (with ``processes``) is ``unreadable``.

    Device memory lands in the job's memory cgroup (issue 23, 3): the driver copies it into
    host allocations of the process. With ``cgroups`` (a ``FakeCgroups``), a ``checkpoint``
    adds the process's device bytes to the usage of every limited cgroup above it
    (``cgroups.limits``) and a ``restore`` takes them off again; a checkpoint that takes one
    over its limit OOM-kills the process in the middle of it (with ``processes``: terminated
    there), records its pid in ``oom_killed`` and raises ``GpuFailed``
    (``CUDA_ERROR_OPERATING_SYSTEM``, naming the cgroup), its CUDA state lost (FAILED).

    Records: ``calls`` (``(method, pid)`` for every call of the checkpointer, in order, also
    those that failed), ``lock_timeouts`` (pid -> ``timeout_ms`` of its last lock),
    ``inventory_calls``, ``visible_calls`` (the pids asked about). With ``events``, each
    successful lock / checkpoint / restore / unlock appends ``"gpu.<method> <pid>"``, a
    failed one ``"gpu.<method>-failed <pid>"``. With a ``clock``, a successful call advances
    it by ``durations[method]``. Thread-safe.
    """

    def __init__(
        self,
        gpus: Sequence[GpuInfo] | None = None,
        *,
        driver_version: str = "580.159.03",
        cuda_version: int = 13000,
        processes: FakeProcessTable | None = None,
        clock: FakeClock | None = None,
        events: list[str] | None = None,
        threads: FakeThreadHold | None = None,
        cgroups: FakeCgroups | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.cgroups = cgroups
        self.oom_killed: list[int] = []
        """Pids OOM-killed in a checkpoint by their memory cgroup (class doc)."""
        self.threads = threads
        self.restore_tids: dict[int, int] = {}
        self.gpus: list[GpuInfo] = list(gpus) if gpus is not None else [H100]
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.processes = processes
        self.clock = clock
        self.events = events
        self.cuda: dict[int, FakeCudaProcess] = {}
        """The CUDA processes by pid."""
        self.fail_lock_timeout: set[int] = set()
        self.lock_timeout_code = NOT_READY
        self.fail_illegal_state_once: set[int] = set()
        self.fail_checkpoint: set[int] = set()
        self.fail_restore: set[int] = set()
        self.fail_unlock: set[int] = set()
        self.poison_restore: set[int] = set()
        """A failed ``restore`` of these pids leaves them FAILED (the driver's "CUDA state
        lost"), not CHECKPOINTED: no call but ``state`` succeeds on them after."""
        self.fail_code = "CUDA_ERROR_OPERATING_SYSTEM"
        self.unavailable: str | None = None
        self.remap_refused: str | None = None
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: dict[int, int] = {}
        self.restore_maps: dict[int, dict[str, str] | None] = {}
        self.inventory_calls = 0
        self.visible: dict[int, tuple[str, ...] | None] = {}
        self.visible_calls: list[int] = []
        self.while_stopped: list[tuple[str, int]] = []
        """``(method, pid)`` of each restore / unlock asked while the restore thread could
        not run (the process STOPPED, or that thread held)."""
        self.while_unheld: list[tuple[str, int]] = []
        """``(method, pid)`` of each restore / unlock asked (with ``threads``) while the
        process's other threads were not held."""
        self.durations = {"lock": 0.01, "checkpoint": 0.5, "restore": 0.25, "unlock": 0.01}
        self.nccl: set[int] = set()
        self.mig: set[str] = set()
        self.ipc: set[int] = set()
        self.launch_jobs: dict[int, str] = {}
        self.hang_s = 600.0
        self.hung: list[int] = []
        """Pids whose ``lock`` hung behind a locked NCCL peer (class doc)."""
        self.facts_calls: list[int] = []
        self.ran_unrestored: list[int] = []
        """Pids that ran (not held) before their CUDA state was back (class doc)."""
        if processes is not None:
            processes.watchers.append(self._saw_state)

    # ---- set-up and inspection -------------------------------------------------------------

    def add_cuda_process(
        self,
        pid: int,
        memory: int = 2**30,
        *,
        gpus: Sequence[str] | None = None,
        state: CudaState = CudaState.RUNNING,
    ) -> FakeCudaProcess:
        """Make ``pid`` a CUDA process holding ``memory`` bytes on each GPU of ``gpus``
        (UUIDs; default: the first GPU). Raises ValueError for an unknown GPU."""
        known = {g.uuid for g in self.gpus}
        where = list(gpus) if gpus is not None else [self.gpus[0].uuid]
        unknown = [u for u in where if u not in known]
        if unknown:
            raise ValueError(f"no such GPU in this FakeGpu: {unknown}")
        proc = FakeCudaProcess(pid, {u: memory for u in where}, state)
        if state is CudaState.CHECKPOINTED:
            proc.checkpointed_on = {g.uuid: g.name for g in self.gpus}
        with self._lock:
            self.cuda[pid] = proc
        return proc

    def remove_cuda_process(self, pid: int) -> None:
        """Forget ``pid`` (the process exited and its CUDA state with it)."""
        with self._lock:
            self.cuda.pop(pid, None)

    def set_visible(self, pid: int, uuids: Sequence[str] | None) -> None:
        """Make ``pid`` see only ``uuids`` (None: every GPU; ``()``: none). Raises
        ValueError for an unknown GPU."""
        known = {g.uuid for g in self.gpus}
        unknown = [u for u in uuids or () if u not in known]
        if unknown:
            raise ValueError(f"no such GPU in this FakeGpu: {unknown}")
        with self._lock:
            self.visible[pid] = None if uuids is None else tuple(dict.fromkeys(uuids))

    def cuda_state(self, pid: int) -> CudaState | None:
        """The state of ``pid`` without recording a call (None: not a CUDA process)."""
        with self._lock:
            proc = self.cuda.get(pid)
            return proc.state if proc is not None else None

    # ---- GpuInventoryPort ----------------------------------------------------------------

    def inventory(self) -> GpuInventory:
        """The GPUs, with each one's free memory net of the device memory held, and the
        uses of every live CUDA process not CHECKPOINTED."""
        with self._lock:
            self.inventory_calls += 1
            if self.unavailable is not None:
                return GpuInventory(False, self.unavailable)
            uses = self._live_uses()
            gpus = tuple(
                replace(g, memory_free=max(0, g.memory_total - self._held(g.uuid, uses)))
                for g in self.gpus
            )
            if not gpus:
                return GpuInventory(
                    False,
                    f"the NVIDIA driver {self.driver_version} sees no GPU",
                    driver_version=self.driver_version,
                    cuda_version=self.cuda_version,
                )
            return GpuInventory(
                True,
                f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) != 1 else ''} (FakeGpu)",
                driver_version=self.driver_version,
                cuda_version=self.cuda_version,
                gpus=gpus,
                uses=uses,
                mig_enabled=tuple(g.uuid for g in gpus if g.uuid in self.mig),
            )

    def visible_to(self, pid: int) -> tuple[str, ...] | None:
        """What ``pid`` sees (``visible``; see the class doc)."""
        with self._lock:
            self.visible_calls.append(pid)
            if not self._alive(pid):
                raise GpuUnavailable(
                    f"cannot tell which GPUs pid {pid} sees: no such process", pid=pid
                )
            seen = self.visible.get(pid)
            if seen is None:
                return None
            if self.unavailable is not None:
                return ()
            return tuple(g.uuid for g in self.gpus if g.uuid in seen)

    # ---- CudaProcessFacts ----------------------------------------------------------------

    def cuda_facts(self, pid: int) -> CudaProcessFact:
        """What /proc would show of ``pid`` (class doc); never raises."""
        with self._lock:
            self.facts_calls.append(pid)
            if not self._alive(pid):
                return CudaProcessFact(pid, unreadable="No such process")
            return CudaProcessFact(
                pid, nccl=pid in self.nccl, launch_job=self.launch_jobs.get(pid, "")
            )

    # ---- GpuCheckpointer -----------------------------------------------------------------

    def uses_cuda(self, pid: int) -> bool:
        """Whether ``pid`` is a live CUDA process (see the class doc)."""
        with self._lock:
            self.calls.append(("uses_cuda", pid))
            proc = self.cuda.get(pid)
            if proc is None or not self._alive(pid):
                return False
            if self.unavailable is not None:
                if proc.state is CudaState.CHECKPOINTED:
                    return False
                raise GpuUnavailable(
                    f"pid {pid} uses an NVIDIA GPU but cannot be checkpointed: "
                    f"{self.unavailable}",
                    pid=pid,
                )
            return True

    def state(self, pid: int) -> CudaState:
        """The pid's state; like ``restore`` and ``unlock``, refused (``while_stopped``) when
        the pid is STOPPED or held but for a thread other than its restore thread: the
        driver answers GetState through that thread (seen on an H100, driver 580.159: on a
        restored, still stopped process the call never answered)."""
        with self._lock:
            self.calls.append(("state", pid))
            proc = self._target("state", pid)
            if self.processes is not None and self._alive(pid):
                tid = self.restore_tids.get(pid, pid + RESTORE_TID_OFFSET)
                held = self.threads.held.get(pid) if self.threads is not None else None
                if self.processes.status(pid).state is PidState.STOPPED and held != tid:
                    self.while_stopped.append(("state", pid))
                    raise self._failed("state", pid, NOT_READY, "the process is stopped: "
                                       "the driver's restore thread cannot run")
            return proc.state

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED (or a failure injected for ``pid``)."""
        with self._lock:
            self.calls.append(("lock", pid))
            self.lock_timeouts[pid] = timeout_ms
            if timeout_ms < 0:
                raise self._failed("lock", pid, "INVALID_TIMEOUT", f"{timeout_ms} ms")
            proc = self._target("lock", pid)
            if pid in self.fail_illegal_state_once:
                self.fail_illegal_state_once.discard(pid)
                raise self._failed("lock", pid, ILLEGAL_STATE, "the process is in cuInit")
            self._expect("lock", proc)
            if any(u in self.mig for u in proc.memory):
                raise self._failed("lock", pid, NOT_SUPPORTED, "the GPU is in MIG mode")
            self._hang_behind_nccl_peer(pid, timeout_ms)
            if pid in self.fail_lock_timeout:
                raise self._failed(
                    "lock", pid, self.lock_timeout_code, f"not locked within {timeout_ms} ms"
                )
            self._move("lock", proc)

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: the process's device memory is freed."""
        with self._lock:
            self.calls.append(("checkpoint", pid))
            proc = self._target("checkpoint", pid)
            self._expect("checkpoint", proc)
            if pid in self.ipc and not self._launch_job_on_r610(pid):
                raise self._failed("checkpoint", pid, NOT_SUPPORTED, "CUDA IPC memory")
            if pid in self.fail_checkpoint:
                raise self._failed("checkpoint", pid, self.fail_code, "injected")
            self._charge(proc, sum(proc.memory.values()))
            proc.checkpointed_on = {g.uuid: g.name for g in self.gpus}
            self._move("checkpoint", proc)

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED, onto the GPUs of ``gpu_map`` when given."""
        with self._lock:
            self.calls.append(("restore", pid))
            pairs = dict(gpu_map) if gpu_map else {}
            self.restore_maps[pid] = pairs or None
            proc = self._target("restore", pid)
            self._need_restore_thread("restore", pid)
            remap = any(old != new for old, new in pairs.items())
            refusal = self.remap_refusal() if remap else None
            if refusal is not None:
                self._event("restore-failed", pid)
                raise GpuUnavailable(refusal, pid=pid)
            self._expect("restore", proc)
            if pid in self.fail_restore:
                if pid in self.poison_restore:
                    proc.state = CudaState.FAILED
                raise self._failed("restore", pid, self.fail_code, "injected")
            self._check_map(proc, pairs, remap)
            memory = self._remapped(proc, pairs) if remap else dict(proc.memory)
            self._check_fits(pid, memory)
            proc.memory = memory
            proc.checkpointed_on = {}
            self._charge(proc, -sum(memory.values()))
            self._move("restore", proc)

    def restore_thread(self, pid: int) -> int:
        """The pid's restore thread (class doc)."""
        with self._lock:
            self.calls.append(("restore_thread", pid))
            self._target("restore_thread", pid)
            return self.restore_tids.get(pid, pid + RESTORE_TID_OFFSET)

    def remap_refusal(self) -> str | None:
        """Why this fake cannot restore onto other GPUs (class doc); None: it can."""
        with self._lock:
            if self.remap_refused is not None:
                return self.remap_refused
            if self.cuda_version < 13000:
                return (
                    "restoring onto other GPUs needs an r580 / CUDA 13.0 driver; this driver "
                    f"is CUDA {self.cuda_version // 1000}.{self.cuda_version % 1000 // 10}"
                )
            return None

    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        with self._lock:
            self.calls.append(("unlock", pid))
            proc = self._target("unlock", pid)
            self._need_restore_thread("unlock", pid)
            self._expect("unlock", proc)
            if pid in self.fail_unlock:
                raise self._failed("unlock", pid, self.fail_code, "injected")
            self._move("unlock", proc)

    # ---- internals -----------------------------------------------------------------------

    def _hang_behind_nccl_peer(self, pid: int, timeout_ms: int) -> None:
        """The lock of an NCCL rank while another rank is held (class doc)."""
        if pid not in self.nccl:
            return
        held = [
            p for p in sorted(self.nccl - {pid})
            if p in self.cuda and self._alive(p)
            and self.cuda[p].state in (CudaState.LOCKED, CudaState.CHECKPOINTED)
        ]
        if not held:
            return
        self.hung.append(pid)
        if self.clock is not None:
            self.clock.advance(timeout_ms / 1000 if timeout_ms > 0 else self.hang_s)
        code = self.lock_timeout_code if timeout_ms > 0 else "TIMEOUT"
        raise self._failed(
            "lock", pid, code, f"its NCCL peer {held[0]} is locked: the collective waits"
        )

    def _launch_job_on_r610(self, pid: int) -> bool:
        head = self.driver_version.split(".", 1)[0]
        return pid in self.launch_jobs and head.isdigit() and int(head) >= 610

    def _charge(self, proc: FakeCudaProcess, size: int) -> None:
        """Add ``size`` bytes (negative: take them off) to the usage of every limited cgroup
        above ``proc`` (class doc); over a limit, the process is OOM-killed and this raises."""
        if self.cgroups is None or not size:
            return
        try:
            where = self.cgroups.cgroup_of(proc.pid)
        except CkptdError:
            return  # gone, or outside: nothing of it is charged here
        limits = self.cgroups.limits
        above = [c for c in limits if where == c or where.startswith(c.rstrip("/") + "/")]
        full = [c for c in above if size > 0 and limits[c][1] + size > limits[c][0]]
        if full:
            self.oom_killed.append(proc.pid)
            proc.state = CudaState.FAILED
            if self.processes is not None:
                self.processes.terminate(proc.pid)
            limit, usage = limits[full[0]]
            raise self._failed("checkpoint", proc.pid, "CUDA_ERROR_OPERATING_SYSTEM",
                               f"OOM-killed: its cgroup {full[0]} (limit {limit}, usage "
                               f"{usage}) cannot take {size} bytes of device memory")
        for c in above:
            limit, usage = limits[c]
            limits[c] = (limit, max(0, usage + size))

    def _saw_state(self, pid: int, state: PidState) -> None:
        """A watcher of ``processes`` (called inside its lock: reads only, no lock of this
        fake taken, so no lock order to break)."""
        proc = self.cuda.get(pid)
        if state is not PidState.RUNNING or proc is None:
            return
        if not (proc.state is CudaState.CHECKPOINTED
                or (proc.state is CudaState.LOCKED and proc.restored)):
            return
        tid = self.restore_tids.get(pid, pid + RESTORE_TID_OFFSET)
        if self.threads is not None and self.threads.held.get(pid) == tid:
            return  # only its restore thread runs
        self.ran_unrestored.append(pid)
        if self.events is not None:
            self.events.append(f"gpu.ran-unrestored {pid}")

    def _alive(self, pid: int) -> bool:
        if self.processes is None:
            return True
        return self.processes.status(pid).state not in (PidState.FREE, PidState.ZOMBIE)

    def _need_restore_thread(self, method: str, pid: int) -> None:
        """Refuse ``method`` unless the restore thread runs and (with ``threads``) nothing
        else of the process does (class doc)."""
        if self.processes is None:
            return
        tid = self.restore_tids.get(pid, pid + RESTORE_TID_OFFSET)
        held = self.threads.held.get(pid) if self.threads is not None else None
        if self.processes.status(pid).state is PidState.STOPPED or (
                held is not None and held != tid):
            self.while_stopped.append((method, pid))
            raise self._failed(method, pid, NOT_READY,
                               "the process is stopped: the driver's restore thread cannot run")
        if self.threads is not None and held is None:
            self.while_unheld.append((method, pid))
            raise self._failed(method, pid, NOT_READY,
                               "its other threads run before its CUDA state is back (not held)")

    @staticmethod
    def _held(uuid: str, uses: Sequence[GpuUse]) -> int:
        return sum(u.memory for u in uses if u.uuid == uuid)

    def _event(self, what: str, pid: int) -> None:
        if self.events is not None:
            self.events.append(f"gpu.{what} {pid}")

    def _failed(self, method: str, pid: int, code: str, detail: str = "") -> GpuFailed:
        if method in _NEEDS:
            self._event(f"{method}-failed", pid)
        call = _CALLS[method]
        suffix = f" ({detail})" if detail else ""
        return GpuFailed(
            f"{call} for pid {pid} failed: {code}{suffix}", call=call, code=code, pid=pid
        )

    def _target(self, method: str, pid: int) -> FakeCudaProcess:
        if self.unavailable is not None:
            if method in _NEEDS:
                self._event(f"{method}-failed", pid)
            raise GpuUnavailable(self.unavailable, pid=pid)
        if not self._alive(pid):
            raise self._failed(method, pid, "NO_SUCH_PROCESS", "no such process")
        proc = self.cuda.get(pid)
        if proc is None:
            raise self._failed(method, pid, INVALID_VALUE, "not a CUDA process")
        return proc

    def _expect(self, method: str, proc: FakeCudaProcess) -> None:
        need = _NEEDS[method]
        if proc.state is not need:
            raise self._failed(
                method, proc.pid, ILLEGAL_STATE, f"the process is {proc.state.name}"
            )

    def _move(self, method: str, proc: FakeCudaProcess) -> None:
        proc.state = _AFTER[method]
        proc.restored = method == "restore"
        if self.clock is not None:
            self.clock.advance(self.durations.get(method, 0.0))
        self._event(method, proc.pid)

    def _check_map(self, proc: FakeCudaProcess, pairs: dict[str, str], remap: bool) -> None:
        """The driver's rules for the GPUs of a restore (class doc); raises ``GpuFailed``
        ``CUDA_ERROR_INVALID_VALUE`` (and changes nothing) when one is broken."""
        was = proc.checkpointed_on or dict.fromkeys(proc.memory, "")
        here = {g.uuid: g.name for g in self.gpus}

        def refuse(detail: str) -> GpuFailed:
            return self._failed("restore", proc.pid, INVALID_VALUE, detail)

        if len(here) != len(was):
            raise refuse(f"checkpointed on {len(was)} GPUs, this node has {len(here)}")
        if not remap:
            gone = sorted(set(was) - set(here))
            if gone:
                raise refuse(f"no GPU map and the GPUs {', '.join(gone)} are gone")
            return
        missing = sorted(set(was) - set(pairs))
        if missing:
            raise refuse(f"the GPU map lacks {', '.join(missing)}")
        extra = sorted(set(pairs) - set(was))
        if extra:
            raise refuse(f"the GPU map names {', '.join(extra)}, not checkpointed")
        if len(set(pairs.values())) != len(pairs):
            raise refuse("the GPU map puts two GPUs onto one")
        for old, new in sorted(pairs.items()):
            if new not in here:
                raise refuse(f"no GPU {new}")
            if was[old] and was[old] != here[new]:
                raise refuse(f"{new} is a {here[new]}, not a {was[old]}")

    def _remapped(self, proc: FakeCudaProcess, pairs: dict[str, str]) -> dict[str, int]:
        memory: dict[str, int] = {}
        for old, used in proc.memory.items():
            new = pairs[old]
            memory[new] = memory.get(new, 0) + used
        return memory

    def _check_fits(self, pid: int, memory: dict[str, int]) -> None:
        live = self._live_uses()
        for gpu in self.gpus:
            need = memory.get(gpu.uuid, 0)
            if need and need > gpu.memory_total - self._held(gpu.uuid, live):
                raise self._failed("restore", pid, OUT_OF_MEMORY, f"{gpu.uuid} lacks memory")

    def _live_uses(self) -> tuple[GpuUse, ...]:
        """Device memory held now: by live CUDA processes that are not CHECKPOINTED."""
        return tuple(
            GpuUse(proc.pid, uuid, memory)
            for proc in sorted(self.cuda.values(), key=lambda p: p.pid)
            if proc.state is not CudaState.CHECKPOINTED and self._alive(proc.pid)
            for uuid, memory in sorted(proc.memory.items())
        )

if TYPE_CHECKING:

    def _is_an_inventory(gpu: FakeGpu) -> GpuInventoryPort:
        return gpu

    def _is_a_checkpointer(gpu: FakeGpu) -> GpuCheckpointer:
        return gpu

    def _is_cuda_process_facts(gpu: FakeGpu) -> CudaProcessFacts:
        return gpu
