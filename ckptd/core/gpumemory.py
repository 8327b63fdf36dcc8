"""Device memory is host memory of the job while its CUDA state is checkpointed.

The driver's checkpoint copies each process's device memory "to the host into allocations
managed by the CUDA driver" (NVIDIA cuda-checkpoint README, "Suspension": Copy-out), that is
into the process's own memory, charged to its memory cgroup; CRIU then dumps it as ordinary
pages, and a restored tree holds it again until the driver's restore moves it back. So:

- a dump refuses (``refuse_without_room``, before anything is locked or frozen) a tree whose
  memory cgroup cannot take its CUDA processes' device memory on top of what it holds now
  (``memory.max`` - ``memory.current``): the kernel would OOM-kill the job in the middle of
  the checkpoint;
- a restore counts the recorded device bytes (``device_bytes``) with the resident memory the
  record holds (read before the checkpoint copied anything) when it checks a memory limit.

Device bytes per process are NVML's per-process used memory, from the GPU inventory taken
when the tree was inspected (``GpuSession.inventory``; the record's ``GpuFacts.uses``): it
includes the context's own overhead, so it errs on the side of refusing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ckptd.core.gpu import GpuSession
from ckptd.core.ports import Cgroups, MemoryLimit
from ckptd.domain import CheckpointRecord, GpuUse
from ckptd.errors import CkptdError, TargetRefused

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20


def size(n: int) -> str:
    """Bytes in words: ``1.2 GiB``, ``4 GiB``, ``512 MiB``."""
    if n >= GiB:
        return f"{round(n / GiB, 1):g} GiB"
    return f"{round(n / MiB, 1):g} MiB"


def device_bytes(uses: Iterable[GpuUse], pids: Iterable[int] | None = None) -> int:
    """Device memory held by ``pids`` (every process of ``uses`` when None), all GPUs."""
    wanted = None if pids is None else set(pids)
    return sum(u.memory for u in uses if wanted is None or u.pid in wanted)


def record_device_bytes(record: CheckpointRecord) -> int:
    """The device memory a checkpoint's CUDA processes held (0: no CUDA)."""
    if record.gpu is None:
        return 0
    return device_bytes(record.gpu.uses, record.gpu.cuda_pids)


def refuse_without_room(cgroups: Cgroups | None, session: GpuSession, root_pid: int) -> None:
    """Raise ``TargetRefused`` (one line: needed, free, limit) when a memory cgroup of the
    tree's CUDA processes cannot hold their device memory on top of its usage now. Processes
    under the same limiting cgroup are summed. A cgroup that cannot be read (the process
    gone, outside the daemon's namespace) is not checked; no limit: nothing to check."""
    if cgroups is None or not session.cuda_pids or session.inventory is None:
        return
    by_cgroup: dict[str, tuple[MemoryLimit, list[int], int]] = {}
    for pid in session.cuda_pids:
        need = device_bytes(session.inventory.uses, (pid,))
        if not need:
            continue
        try:
            limit = cgroups.memory_limit(pid)
        except CkptdError as exc:
            log.info("the memory limit of pid %d cannot be read (%s): not checked", pid, exc)
            continue
        if limit is None:
            continue
        _, pids, total = by_cgroup.get(limit.cgroup, (limit, [], 0))
        by_cgroup[limit.cgroup] = (limit, [*pids, pid], total + need)
    for cgroup, (limit, pids, need) in by_cgroup.items():
        if need <= limit.free:
            continue
        who = (f"pid {pids[0]}'s cgroup" if len(pids) == 1
               else f"the cgroup of pids {', '.join(map(str, pids))}")
        raise TargetRefused(
            f"{who} {cgroup} can hold {size(limit.free)} more (limit {size(limit.limit)}, "
            f"{size(limit.usage)} used) but its CUDA checkpoint needs {size(need)} of host "
            "memory for device memory",
            hint=f"raise memory.max of {cgroup} to at least {size(limit.usage + need)}, or "
                 "checkpoint when the job holds less device memory",
            pid=pids[0] if pids[0] == root_pid else root_pid,
        )
