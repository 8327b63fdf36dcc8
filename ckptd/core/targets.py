"""Checks that a process may be checkpointed by a caller, before anything is touched."""

from __future__ import annotations

from collections.abc import Sequence

from ckptd.core.ports import ProcessTable
from ckptd.domain import Caller, PidState, PidStatus, ProcessFact, TcpConnection
from ckptd.errors import InvalidTarget, PermissionDenied, ProcessNotFound, TargetRefused


def check_dump_target(
    processes: ProcessTable, caller: Caller, pid: int, daemon_pid: int
) -> tuple[ProcessFact, ...]:
    """The tree rooted at ``pid`` if ``caller`` may checkpoint it; raises with the reason."""
    if pid <= 0:
        raise InvalidTarget(f"invalid pid {pid}", hint="give a positive process id", pid=pid)
    status = processes.status(pid)
    check_process_target(processes, pid, status, daemon_pid)
    if status.state is PidState.ZOMBIE:
        raise TargetRefused(
            f"pid {pid} ({status.comm}) is a zombie: it has exited and waits for its parent "
            f"{status.ppid} to reap it",
            hint="there is nothing left to checkpoint",
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
    check_namespaces(processes, pid, status)
    if not caller.is_root and status.uid != caller.uid:
        raise PermissionDenied(
            f"pid {pid} belongs to uid {status.uid}, the caller is uid {caller.uid}", pid=pid
        )
    check_not_traced(status)
    tree = processes.tree(pid)
    if not tree:
        raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
    check_no_nested_pid_namespace(processes, pid, status, tree)
    if not caller.is_root:
        for proc in tree:
            if proc.uid != caller.uid:
                raise PermissionDenied(
                    f"process {proc.pid} ({proc.comm}) in the tree of pid {pid} belongs to "
                    f"uid {proc.uid}, the caller is uid {caller.uid}",
                    pid=pid,
                )
    check_no_io_uring(processes, pid, tree)
    return tree


def check_process_target(
    processes: ProcessTable, pid: int, status: PidStatus, daemon_pid: int
) -> None:
    """What no dump, policy or drain may ever name: no process, a thread instead of a
    process, pid 1, a kernel thread, the daemon or one of its ancestors."""
    if status.state is PidState.FREE:
        raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
    if status.tgid and status.tgid != pid:
        raise InvalidTarget(
            f"pid {pid} is a thread of process {status.tgid} ({status.comm}), not a process",
            hint=f"name the process: {status.tgid}", pid=pid,
        )
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
    if pid == daemon_pid or pid in processes.ancestors(daemon_pid):
        raise TargetRefused(
            f"pid {pid} is the ckptd daemon or one of its ancestors",
            hint="ckptd cannot checkpoint itself; name the job's own process",
            pid=pid,
        )


def check_not_traced(status: PidStatus) -> None:
    """A process under another tracer (strace, gdb) cannot be seized by CRIU: say who."""
    if status.tracer:
        raise TargetRefused(
            f"pid {status.pid} is being traced by PID {status.tracer} (strace/gdb?)",
            hint="detach the tracer and retry", pid=status.pid,
        )


IO_URING_WAY_OUT = (
    "launch it through `ckptctl run` (which keeps io_uring away from jobs), or turn the "
    "library's io_uring use off (e.g. PyTorch: USE_LIBUV=0 for init_method=env:// ranks)"
)


def check_no_io_uring(processes: ProcessTable, pid: int, tree: tuple[ProcessFact, ...]) -> None:
    """CRIU cannot checkpoint an io_uring instance (it fails on the frozen tree, ``Unknown
    shit 600 (anon_inode:[io_uring])``): refuse before anything is frozen, naming the
    processes that hold one and the way out."""
    holders = set(processes.io_uring_holders(tree))
    held = [p for p in tree if p.pid in holders]
    if not held:
        return
    first = held[0]
    if first.pid == pid:
        who = f"pid {pid} ({first.comm})"
    else:
        who = f"process {first.pid} ({first.comm}) in the tree of pid {pid}"
    others = [f"{p.pid} ({p.comm})" for p in held[1:4]]
    others += [f"{len(held) - 4} more"] if len(held) > 4 else []
    more = f" (so do {', '.join(others)})" if others else ""
    raise TargetRefused(
        f"{who} holds an io_uring instance{more}, which CRIU cannot checkpoint",
        hint=IO_URING_WAY_OUT,
        pid=pid,
    )


HANDLED_NAMESPACES = frozenset({"pid", "uts", "ipc", "cgroup", "time"})
"""Namespaces of its own a tree may have: CRIU dumps them and a restore creates new ones
(each checked with a real dump and restore)."""

_NOT_YET = {
    "mnt": "a mount namespace of its own (a container's root filesystem and mounts, which "
           "ckptd does not record yet: container support is issue #12)",
    "user": "a user namespace of its own (rootless containers; CRIU cannot restore its uid "
            "maps from ckptd yet)",
    "net": "a network namespace of its own (CRIU must lock it during the dump, and ckptd does "
           "not yet drive CRIU's nftables lock nor recreate its links to the node: issue #12)",
}


CONTAINER_SHARED = ("pid", "mnt", "net", "ipc", "uts", "cgroup", "user", "time")
"""What a container job shares with its container's init (CRIU is run in the same ones)."""


def container_init(processes: ProcessTable, pid: int, status: PidStatus) -> int:
    """The init of the container ``pid`` is a job of (the daemon's pid), or 0: a container
    job is in a pid namespace one level below the daemon's, together with a mount namespace
    of its own, is not that namespace's init, and shares every namespace with it (user and
    time are the daemon's). CRIU then runs inside the container and dumps a plain tree
    (docs/design/containers.md)."""
    if len(status.ns_pids) != 2 or status.ns_pids[-1] == 1:
        return 0
    foreign = processes.foreign_namespaces(pid)
    if "pid" not in foreign or "mnt" not in foreign or foreign & {"user", "time"}:
        return 0
    init = processes.pid_namespace_init(pid)
    if init <= 0 or init == pid:
        return 0
    if processes.namespaces_differing(pid, init) & set(CONTAINER_SHARED):
        return 0
    return init


def container_job(processes: ProcessTable, pid: int) -> int:
    """When ``pid`` names a container (its init: pid 1 of a pid namespace one level below
    the daemon's, with a mount namespace and a root file system of its own, in the node's
    user and time namespaces), the root of its job: the init's only child, itself a container job
    (``container_init``). 0 when ``pid`` is not a container's init, or has no child (it is
    the job itself: the usual checks refuse it). Raises TargetRefused when it has several
    children (naming them): which is the job cannot be told."""
    status = processes.status(pid)
    if status.state is PidState.FREE or len(status.ns_pids) != 2 or status.ns_pids[-1] != 1:
        return 0
    foreign = processes.foreign_namespaces(pid)
    if "mnt" not in foreign or foreign & {"user", "time"} or not processes.own_root(pid):
        return 0  # (``unshare --pid --mount-proc CMD`` keeps the node's root: CMD is the job)
    children = [f for f in processes.tree(pid) if f.ppid == pid]
    if not children:
        return 0  # the init is the job itself (``unshare --pid --mount-proc CMD``): refused
    if len(children) > 1:
        named = ", ".join(f"{c.pid} ({c.comm})" for c in children[:5])
        raise TargetRefused(
            f"pid {pid} ({status.comm}) is a container's init with {len(children)} children "
            f"({named}): which one is the job cannot be told",
            hint="checkpoint the job by its pid, or by the name `ckptctl run --name` gave it",
            pid=pid)
    child = children[0]
    if container_init(processes, child.pid, processes.status(child.pid)) != pid:
        return 0  # not a plain job of that container: the usual checks say why
    return child.pid


def container_of_cgroup(processes: ProcessTable, cgroup: str, pids: Sequence[int]) -> int:
    """The init of the container whose cgroup ``cgroup`` holds ``pids`` (the one process
    there that is pid 1 of a pid namespace below the daemon's). Raises InvalidTarget."""
    inits = []
    for pid in pids:
        status = processes.status(pid)
        if len(status.ns_pids) == 2 and status.ns_pids[-1] == 1:
            inits.append((pid, status.comm))
    if len(inits) == 1:
        return inits[0][0]
    if not inits:
        raise InvalidTarget(
            f"cgroup {cgroup} holds no container init (pid 1 of a pid namespace of its own; "
            f"{len(pids)} processes there)",
            hint="give the container's own cgroup (its leaf, not the pod's), or the job's pid")
    named = ", ".join(f"{p} ({c})" for p, c in inits[:5])
    raise InvalidTarget(
        f"cgroup {cgroup} holds {len(inits)} container inits ({named})",
        hint="give one container's own cgroup, or the job's pid")


def check_namespaces(processes: ProcessTable, pid: int, status: PidStatus) -> int:
    """Refuse, before anything is touched, a target whose namespaces CRIU or ckptd cannot
    bring back: a process inside a pid namespace that is not its init (unless it is a
    container job: ``container_init``), a nested one, or a namespace kind not handled yet.
    Returns the container's init for a container job, else 0."""
    init = container_init(processes, pid, status)
    if init:
        return init
    foreign = processes.foreign_namespaces(pid)
    what = f"pid {pid} ({status.comm})"
    if "pid" in foreign and status.ns_pids:
        inner = status.ns_pids[-1]
        if inner != 1:
            raise TargetRefused(
                f"{what} is pid {inner} inside a pid namespace of its own, not that "
                "namespace's init: CRIU checkpoints a pid namespace only whole, from its init",
                hint="checkpoint the namespace's init (pid 1 inside it; for a container, its "
                     "init process) instead",
                pid=pid,
            )
        if len(status.ns_pids) > 2:
            raise TargetRefused(
                f"{what} is the init of a pid namespace nested {len(status.ns_pids) - 1} "
                "levels below the daemon's: ckptd restores one level only",
                hint="checkpoint the outermost namespace's init, or run ckptd inside the "
                     "outer namespace",
                pid=pid,
            )
    for kind, why in _NOT_YET.items():
        if kind in foreign:
            raise TargetRefused(
                f"{what} has {why}",
                hint="run the job in the node's mount, user and network namespaces (e.g. "
                     "`unshare --fork --pid CMD`, without --mount/--mount-proc/--user/--net)",
                pid=pid,
            )
    return 0


def check_no_nested_pid_namespace(
    processes: ProcessTable, pid: int, root: PidStatus, tree: tuple[ProcessFact, ...]
) -> None:
    """CRIU cannot dump a tree with a pid namespace nested in it (``unshare --fork --pid``
    run by the job): refuse before anything is frozen, naming the init to checkpoint."""
    depth = len(root.ns_pids)
    for proc in tree[1:]:
        status = processes.status(proc.pid)
        if depth and status.ns_pids and len(status.ns_pids) != depth:
            raise TargetRefused(
                f"process {proc.pid} ({proc.comm}) in the tree of pid {pid} is in a pid "
                "namespace nested in the tree's, and CRIU cannot checkpoint nested pid "
                "namespaces",
                hint=f"checkpoint the nested namespace's init instead (`ckptctl dump "
                     f"{proc.pid}` if it is that init)",
                pid=pid,
            )


def check_tcp(
    connections: Sequence[TcpConnection], pid: int, *, tcp_close: bool, peers_dumped: bool
) -> None:
    """Refuse (before anything is frozen) a tree with a TCP connection whose other end is not
    in the tree, unless the request says its connections come back closed (``tcp_close``; the
    dump passes True too when the daemon restores such connections, its default) or that the
    peers are checkpointed with it (a group). A connection its peer reset (CLOSE) is never
    refused: it comes back as it was, closed."""
    if tcp_close or peers_dumped:
        return
    ends = {(c.local, c.remote) for c in connections}
    for conn in connections:
        # a connection its peer reset (CLOSE) has nobody left to talk to: it comes back closed
        if conn.state != "CLOSE" and (conn.remote, conn.local) not in ends:
            raise TargetRefused(
                f"pid {conn.pid} ({conn.comm}) has a TCP connection {conn.local} -> "
                f"{conn.remote} to a peer outside the tree of pid {pid}, and this daemon "
                "refuses those (tcp_outside_peers = \"refuse\")",
                hint="checkpoint the peer with it (a group), dump with --tcp-close to "
                "restore the tree's connections closed (the application sees a reset), or set "
                "tcp_outside_peers = \"restore\"",
                pid=pid,
            )
