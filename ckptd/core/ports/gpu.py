"""The GPU ports: the node's GPUs, and CUDA processes checkpointed by the driver."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ckptd.domain import CudaState, GpuInventory


class GpuInventoryPort(Protocol):
    """This node's GPUs (NVML). ``inventory`` never raises: an unusable driver is
    ``available=False``."""

    def inventory(self) -> GpuInventory: ...

    def visible_to(self, pid: int) -> tuple[str, ...] | None:
        """The UUIDs of this node's GPUs that process ``pid`` (a host pid) can use, or None
        when nothing restricts it. In a container: those with a ``/dev/nvidia<N>`` node in
        its root (none at all: ``()``); anywhere: narrowed by the ``*_VISIBLE_DEVICES`` it
        was started with. Every UUID is one of ``inventory()``'s GPUs, each once, in
        ``inventory()``'s order. Raises ``GpuUnavailable`` when ``pid`` cannot be inspected
        (gone, not permitted)."""
        ...


@dataclass(frozen=True)
class CudaProcessFact:
    """What /proc shows of one process that the driver's checkpoint cannot take (read at
    inspect, before anything is frozen). Only what can be seen: CUDA IPC handles
    (``cuIpcOpenMemHandle``) and UVM (managed) allocations leave no mark in /proc that tells
    them apart — every CUDA process maps ``/dev/nvidia-uvm`` — so they are left to the
    driver's own refusal (``GpuSteps`` translates it)."""

    pid: int
    nccl: bool = False
    """A ``libnccl`` shared object is mapped (``/proc/<pid>/maps``)."""
    launch_job: str = ""
    """``CUDA_CHECKPOINT_JOB_FILE`` from the environment it started with: the process was
    started by ``cuda-checkpoint --launch-job`` (the r610 mechanism for CUDA IPC); ""
    when unset."""
    unreadable: str = ""
    """Why its /proc could not be read ("" when it could): the other fields are then
    unknown (False / "")."""


class CudaProcessFacts(Protocol):
    """Per process, what /proc says about workloads the CUDA driver cannot checkpoint."""

    def cuda_facts(self, pid: int) -> CudaProcessFact:
        """``pid``'s facts (a host pid). Never raises: a process whose /proc cannot be read
        (gone, not permitted) gives a fact with ``unreadable`` set."""
        ...


class GpuCheckpointer(Protocol):
    """The CUDA driver's checkpoint API for one process at a time (host pids).

    Every call may block for long (a checkpoint copies all device memory to the host); the
    adapter runs them where they cannot stall the daemon. Failures raise ``GpuFailed`` (the
    call and the driver's error name) or ``GpuUnavailable`` (no driver / API too old).
    """

    def uses_cuda(self, pid: int) -> bool:
        """Whether ``pid`` has a CUDA context (cheap probe; False when no driver)."""
        ...

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED within ``timeout_ms`` (0: no limit in the driver; negative:
        refused). On timeout the process stays RUNNING and GpuFailed is raised (the driver's
        code: CUDA_ERROR_NOT_READY). Every call's wait is bounded by the adapter: past it,
        GpuFailed code TIMEOUT."""
        ...

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: device memory moved into the process's host memory."""
        ...

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED; ``gpu_map`` (old UUID -> new UUID) when this node's GPUs
        differ from the checkpoint's: then a pair for EVERY GPU of the dumping node, identity
        pairs included (the driver refuses an incomplete map with CUDA_ERROR_INVALID_VALUE).
        A map of identity pairs only is no remap."""
        ...

    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        ...

    def restore_thread(self, pid: int) -> int:
        """The tid of ``pid``'s CUDA restore thread (``cuCheckpointProcessGetRestoreThreadId``):
        the driver restores and unlocks on it, so it must run then (``ThreadHold``). Raises
        ``GpuFailed`` when ``pid`` has no CUDA context or the driver cannot tell."""
        ...

    def remap_refusal(self) -> str | None:
        """Why this checkpointer cannot restore onto other GPUs (bindings without the
        types, a driver older than r580, a backend that cannot); None when it can. Asked at
        restore planning, before anything is restored. Never raises."""
        ...
