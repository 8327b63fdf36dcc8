"""A restore into the caller's container (``ckptctl run --name J`` as the next pod's init).

The checkpoint is of a job in a container (``CheckpointRecord.container``): CRIU ran inside
the old container, so the images hold a plain process tree with pids of that container's pid
namespace and paths of its root file system. Such a tree comes back only inside another
container, where CRIU runs in turn (docs/design/containers.md, docs/adr/0011). The caller is
that container's init: the tree becomes its child when CRIU exits, so the container lives as
long as the job and exits with its status.

Checks made here, before anything is touched (the restore recipe's ``resolve``, ``compat``
and ``pids`` steps call them), each refusal naming what to do:

- the caller is the init (pid 1) of a pid namespace below the daemon's, in the node's user
  namespace (rootful containers only), told from the calling process itself, pinned
  (``core.callers.caller_process``: never from another that took its pid);
- every pid of the tree is free in the caller's pid namespace (threads are checked by the
  CRIU adapter just before CRIU, from the images);
- the caller's memory limit leaves room for the tree's resident memory and CRIU's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.core.callers import caller_process
from ckptd.core.gpumemory import record_device_bytes
from ckptd.core.ports import Cgroups, CriuPlacement, ProcessTable
from ckptd.domain import Caller, CheckpointRecord
from ckptd.errors import PermissionDenied, PidInUse, PreconditionFailed, ProcessNotFound

CRIU_MEMORY_MARGIN = 64 << 20
"""What CRIU itself may need under the container's limit while it restores (it runs there)."""

MiB = 1 << 20


@dataclass(frozen=True)
class CallerContainer:
    """The container restored into, named by its init (the caller)."""

    init: int
    """Its init's pid on the node."""
    start_time: int

    def placement(self) -> CriuPlacement:
        return CriuPlacement(init=self.init, init_start_time=self.start_time, ns_pid=0)


def caller_container(
    processes: ProcessTable, caller: Caller, record: CheckpointRecord
) -> CallerContainer:
    """The caller's container, when a restore of ``record`` into it can be asked for at all.
    Raises PreconditionFailed (PermissionDenied for another user's caller) naming why not."""
    if not record.container:
        raise PreconditionFailed(
            f"checkpoint {record.id} is of a job outside containers (pid {record.pid}): it is "
            "restored on the node, not into a container",
            hint=f"restore it with `ckptctl restore {record.id}`", checkpoint_id=record.id)
    pid = caller.pid or 0
    if pid <= 0:
        raise PreconditionFailed(
            "the caller's pid is unknown to the daemon (it is outside the daemon's pid "
            "namespace): the container to restore into cannot be found",
            hint="run the daemon in the node's pid namespace (hostPID in Kubernetes)",
            checkpoint_id=record.id)
    with caller_process(processes, caller, "the container to restore into was found"):
        status = processes.status(pid)
        if not status.ns_pids:
            raise ProcessNotFound(f"the caller (pid {pid}) is gone", pid=pid)
        if len(status.ns_pids) < 2:
            raise PreconditionFailed(
                f"the caller (pid {pid}) is not in a container (it shares the node's pid "
                f"namespace): checkpoint {record.id} can only be restored inside one",
                hint="run `ckptctl run --name NAME -- CMD` as the container's entrypoint",
                pid=pid, checkpoint_id=record.id)
        if status.ns_pids[-1] != 1:
            raise PreconditionFailed(
                f"the caller (pid {pid}) is pid {status.ns_pids[-1]} of its container, not its "
                "init: the restored job must become the child of the container's init",
                hint="make `ckptctl run --name NAME -- CMD` the container's entrypoint (pid 1)",
                pid=pid, checkpoint_id=record.id)
        if "user" in processes.foreign_namespaces(pid):
            raise PreconditionFailed(
                f"the caller (pid {pid}) is in a user namespace of its own (a rootless "
                "container): ckptd restores into rootful containers only",
                hint="run the job in a rootful container (Kubernetes, runc, podman as root)",
                pid=pid, checkpoint_id=record.id)
        if not caller.is_root and status.uid != record.uid:
            raise PermissionDenied(
                f"checkpoint {record.id} belongs to uid {record.uid}, the container's init is "
                f"uid {status.uid}", checkpoint_id=record.id)
        return CallerContainer(init=pid, start_time=status.start_time)


def check_pids_free(
    processes: ProcessTable, into: CallerContainer, record: CheckpointRecord
) -> None:
    """Every process pid of the tree is free in the container. Raises PidInUse naming the
    first one taken (and how many are)."""
    taken = []
    for proc in record.processes:
        holder = processes.ns_pid_taken(into.init, proc.image_pid)
        if holder:
            taken.append((proc.image_pid, holder))
    if taken:
        ns_pid, holder = taken[0]
        raise PidInUse(
            f"pid {ns_pid} of checkpoint {record.id} is taken in the container of pid "
            f"{into.init} (by {holder}; {len(taken)} of the tree's {len(record.processes)} "
            "pids are taken)",
            hint="start the job with `ckptctl run` (it keeps the job's pids above those a "
                 "container's own processes take), and nothing else in the new container "
                 "before it",
            pid=into.init, checkpoint_id=record.id)


def memory_problems(
    cgroups: Cgroups | None, into: CallerContainer, record: CheckpointRecord
) -> list[str]:
    """A blocking line when the container's memory limit leaves less room than the tree's
    resident memory at the checkpoint, plus its CUDA processes' device memory (the driver
    copied it into their memory after that resident size was read; the restored tree holds
    it until the CUDA restore: ``core.gpumemory``), plus CRIU's margin."""
    if cgroups is None:
        return []
    limit = cgroups.memory_limit(into.init)
    if limit is None:
        return []
    resident = sum(p.rss for p in record.processes)
    device = record_device_bytes(record)
    needed = resident + device + CRIU_MEMORY_MARGIN
    if limit.free >= needed:
        return []
    on_gpu = f" plus {device // MiB} MiB of device memory" if device else ""
    return [
        f"the container has {limit.free // MiB} MiB free under its memory limit (cgroup "
        f"{limit.cgroup}: limit {limit.limit // MiB} MiB, {limit.usage // MiB} MiB in use); "
        f"the job needs about {resident // MiB} MiB resident{on_gpu} plus "
        f"{CRIU_MEMORY_MARGIN // MiB} MiB for CRIU: give the container a memory limit of at "
        f"least {(needed + limit.usage) // MiB + 1} MiB"
    ]
