"""The process ports: a process held by a handle, the process table, threads held."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ckptd.domain import PidState, PidStatus, ProcessFact, StdioFact, TcpConnection


class ProcessHandle(Protocol):
    """One process, held from the moment it was identified (a pidfd on Linux).

    Invariant: whatever a handle does reaches the process it was opened on, or nothing:
    once that process is gone its pid may belong to another, and the handle never touches
    it. Pids are the daemon's (its pid namespace). Close it when done (idempotent)."""

    @property
    def pid(self) -> int:
        """The pid it had when identified (the daemon's namespace)."""
        ...

    @property
    def start_time(self) -> int: ...

    def signal(self, signo: int) -> bool:
        """Send ``signo`` to this process; False when it is gone (reaped)."""
        ...

    def state(self) -> PidState:
        """RUNNING, STOPPED, ZOMBIE (exited, not reaped), or FREE (gone)."""
        ...

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for it to exit (zombie or gone); True when it has."""
        ...

    def close(self) -> None: ...


class ProcessLookup(Protocol):
    """What occupies a pid, and a handle on the process found there (what holding
    and signalling a tree needs)."""

    def status(self, pid: int) -> PidStatus:
        """What occupies ``pid`` now (``PidState.FREE`` when nothing)."""
        ...

    def open(self, pid: int, start_time: int = 0) -> ProcessHandle | None:
        """A handle on the process at ``pid`` now; None when the pid is free or (with
        ``start_time`` not 0) holds a process that started at another time."""
        ...


class ProcessTrees(Protocol):
    """A process tree as a dump inspects it: its members, ancestors, stdio, TCP
    connections, io_uring users."""

    def tree(self, pid: int) -> tuple[ProcessFact, ...]:
        """``pid`` and all its descendants, root first, each with its start time and its
        ``ns_pid`` (its pid in the root's pid namespace when that is not the daemon's).
        Raises ProcessNotFound."""
        ...

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """Parent, grandparent, ... up to pid 1 (excluding ``pid``)."""
        ...

    def stdio(self, tree: Sequence[ProcessFact]) -> tuple[StdioFact, ...]:
        """Descriptors 0-2 of every process of ``tree``, with external ones marked."""
        ...

    def tcp_connections(self, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
        """Every connected TCP socket a process of ``tree`` holds (listening ones are not
        connections), with its addresses as seen in that process's network namespace."""
        ...

    def io_uring_holders(self, tree: Sequence[ProcessFact]) -> tuple[int, ...]:
        """The pids of ``tree``, in its order, whose processes hold an io_uring instance (a
        descriptor on one, or a mapping of its rings), which CRIU cannot checkpoint. A process
        gone meanwhile holds none."""
        ...


class PidNamespaces(Protocol):
    """Namespaces and pids seen from them (jobs in containers, trees that are the
    init of their own pid namespace)."""

    def foreign_namespaces(self, pid: int) -> frozenset[str]:
        """The namespaces (``pid``, ``mnt``, ``net``, ``ipc``, ``uts``, ``user``, ``cgroup``,
        ``time``) in which ``pid`` differs from the daemon; empty when it is gone."""
        ...

    def pid_namespace_init(self, pid: int) -> int:
        """The pid (the daemon's namespace) of the init of ``pid``'s pid namespace (pid 1
        inside it; ``pid`` itself when it is that init); 0 when ``pid`` is in the daemon's
        pid namespace, is gone, or no such init is found among its ancestors."""
        ...

    def namespaces_differing(self, pid: int, other: int) -> frozenset[str]:
        """The namespaces (the kinds of ``foreign_namespaces``) in which ``pid`` and
        ``other`` differ; every kind when either is gone."""
        ...

    def reserve_pids(self, pid: int, above: int, start_time: int = 0) -> int:
        """In the pid namespace of ``pid`` (a container's), make the next pids handed out be
        above ``above`` (the counter is never lowered), so that a job started there now can be
        restored into another container whose own processes took the low pids. Returns the
        namespace's counter after; 0 when ``pid`` shares the daemon's pid namespace (nothing
        done). Raises ProcessNotFound when ``pid`` is gone, or (``start_time`` not 0) holds
        a process that started at another time: the namespace is taken from the process
        with that start time only, pinned while it is opened."""
        ...

    def own_root(self, pid: int) -> bool:
        """Whether ``pid``'s root directory is not the daemon's (a container's root file
        system, after pivot_root or chroot); False when it is gone."""
        ...

    def ns_pid_taken(self, init: int, ns_pid: int) -> str:
        """What holds pid ``ns_pid`` of the pid namespace whose init is ``init`` (a node
        pid): its command name, or "" when that pid (process or thread id) is free there."""
        ...


class ProcessTable(ProcessLookup, ProcessTrees, PidNamespaces, Protocol):
    """Read-only view of the host's processes; signals only through ``ProcessHandle`` s. Its
    families, each as small as the callers that take only it (``HeldTree``, ``Undoer``,
    ``caller_process``, ``CgroupPlacement``: ``ProcessLookup``)."""


class ThreadHold(Protocol):
    """Every thread of a process held stopped but one, which runs (docs/adr/0019): how the
    CUDA driver's restore thread restores and unlocks a process while nothing else of it
    runs (as CRIU's CUDA plugin does under ptrace). Pids and tids are the daemon's.

    Invariants: a held thread does not run until ``release``; the free thread is never
    held (it runs once the process is not stopped: a SIGCONT wakes it and only it); threads
    that appear while the hold is taken are held too; a daemon that dies holding releases
    every held thread (the kernel detaches a dead tracer's tracees). Thread-safe."""

    def hold(self, pid: int, free_tid: int) -> tuple[int, ...]:
        """Hold every thread of process ``pid`` except ``free_tid`` (a thread of it); the
        tids held. Raises ``ProcessNotFound`` when ``pid`` is gone, ``PreconditionFailed``
        when a thread cannot be held (another tracer, ptrace not permitted): nothing is
        then left held."""
        ...

    def release(self, pid: int) -> None:
        """Let every thread held for ``pid`` run again (those of a process stopped by a
        signal stay stopped with it); nothing held: nothing done. Never raises."""
        ...
