"""Checks that a process may be checkpointed by a caller, before anything is touched."""

from __future__ import annotations

from ckptd.core.ports import ProcessTable
from ckptd.domain import Caller, PidState, ProcessFact
from ckptd.errors import InvalidTarget, PermissionDenied, ProcessNotFound, TargetRefused


def check_dump_target(
    processes: ProcessTable, caller: Caller, pid: int, daemon_pid: int
) -> tuple[ProcessFact, ...]:
    """The tree rooted at ``pid`` if ``caller`` may checkpoint it; raises with the reason."""
    if pid <= 0:
        raise InvalidTarget(f"invalid pid {pid}", hint="give a positive process id", pid=pid)
    status = processes.status(pid)
    if status.state is PidState.FREE:
        raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
    if pid == 1:
        raise TargetRefused(
            "pid 1 (init) cannot be checkpointed", hint="name the job's own process", pid=pid
        )
    if status.kernel_thread:
        raise TargetRefused(
            f"pid {pid} ({status.comm}) is a kernel thread and cannot be checkpointed",
            hint="name a user-space process",
            pid=pid,
        )
    if status.state is PidState.ZOMBIE:
        raise TargetRefused(
            f"pid {pid} ({status.comm}) is a zombie: it has exited and waits for its parent "
            f"{status.ppid} to reap it",
            hint="there is nothing left to checkpoint",
            pid=pid,
        )
    if pid == daemon_pid or pid in processes.ancestors(daemon_pid):
        raise TargetRefused(
            f"pid {pid} is the ckptd daemon or one of its ancestors",
            hint="ckptd cannot checkpoint itself; name the job's own process",
            pid=pid,
        )
    if status.session == 0:
        raise TargetRefused(
            f"pid {pid} ({status.comm}) is in session 0: its session leader is outside its pid "
            "namespace (it was started by a launcher that never called setsid), and CRIU "
            "cannot checkpoint such a process",
            hint="start the job in a session of its own, e.g. `setsid CMD ...`",
            pid=pid,
        )
    if not caller.is_root and status.uid != caller.uid:
        raise PermissionDenied(
            f"pid {pid} belongs to uid {status.uid}, the caller is uid {caller.uid}", pid=pid
        )
    tree = processes.tree(pid)
    if not tree:
        raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
    if not caller.is_root:
        for proc in tree:
            if proc.uid != caller.uid:
                raise PermissionDenied(
                    f"process {proc.pid} ({proc.comm}) in the tree of pid {pid} belongs to "
                    f"uid {proc.uid}, the caller is uid {caller.uid}",
                    pid=pid,
                )
    return tree
