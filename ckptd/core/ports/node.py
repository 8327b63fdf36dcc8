"""The node's ports: its clock, its cgroups, and what it is (``NodeInspector``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptd.domain import FileKind, FileNeed, NodeFingerprint, ProcessFact


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class Cgroups(Protocol):
    """The node's cgroup v2 hierarchy (the unified one), as the daemon sees it.

    A cgroup is named by its path in the hierarchy (``/`` the root, ``/a/b`` below it), as
    ``/proc/PID/cgroup``'s ``0::`` line says. Moving a process moves all its threads.
    Invariant: a cgroup this port creates is only ever created together with the move that
    populates it, so ``remove_empty`` never removes one that a concurrent ``move`` was about
    to use."""

    def cgroup_of(self, pid: int) -> str:
        """The cgroup of the process at ``pid``. Raises ProcessNotFound when it is gone,
        CgroupUnavailable when it cannot be told (outside the daemon's cgroup namespace)."""
        ...

    def move(self, pids: Sequence[int], cgroup: str, *, create: bool = False) -> None:
        """Move each process of ``pids`` into ``cgroup``; with ``create``, create it first
        when missing (and its missing parents). Raises ProcessNotFound when one is gone,
        CgroupUnavailable naming the cgroup and why it takes no processes (missing; child
        cgroups with controllers enabled: cgroup v2's "no internal processes" rule; an
        invalid domain in a threaded subtree). Processes moved before a failure stay moved."""
        ...

    def remove_empty(self, parent: str) -> list[str]:
        """Remove every child cgroup of ``parent`` that holds no process and no cgroup;
        returns them. Never raises (what cannot be removed stays)."""
        ...

    def procs(self, cgroup: str) -> tuple[int, ...]:
        """The processes in ``cgroup`` itself (not its descendants). Raises
        CgroupUnavailable when it does not exist."""
        ...

    def memory_limit(self, pid: int) -> MemoryLimit | None:
        """The tightest memory limit over the cgroups of ``pid`` (every hierarchy, each
        cgroup and its ancestors) with what is charged there now; None when unlimited.
        Raises ProcessNotFound when ``pid`` is gone."""
        ...


@dataclass(frozen=True)
class MemoryLimit:
    """A cgroup's memory limit (``memory.max``, v1's ``memory.limit_in_bytes``)."""

    cgroup: str
    limit: int
    usage: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


class NodeInspector(Protocol):
    """This node's facts (CPU, kernel, libc) and the files a process tree uses.

    Paths are as this daemon sees them (its mount namespace). Never raises for a process that
    went away or a file that cannot be read: those are left out."""

    def here(self) -> NodeFingerprint:
        """This node's facts; ``files`` empty, ``criu_version`` empty (the core knows CRIU)."""
        ...

    def fingerprint(self, tree: Sequence[ProcessFact]) -> NodeFingerprint:
        """``here()`` plus every path ``tree`` uses (executables, file-backed mappings, open
        regular files, working directories, and the mount points they live on), one entry
        per path, content-hashed when at most ``HASH_LIMIT`` bytes."""
        ...

    def file(self, path: str, kind: FileKind, with_hash: bool) -> FileNeed | None:
        """``path`` as it is on this node now (None: missing). For EXE/MAP/FILE a regular
        file (hashed when ``with_hash`` and small); CWD a directory; MOUNT a mount point."""
        ...

    def has_address(self, address: str) -> bool:
        """Whether this node (the daemon's network namespace) has the local IP address of
        ``address`` (``ip:port`` or ``[ipv6]:port``): a TCP connection from it can be
        restored established here."""
        ...

    def seen_by(self, pid: int) -> NodeInspector:
        """The same inspector with every path resolved as process ``pid`` sees it: in its
        root file system and mount table (a container's), never escaping that root through
        a symbolic link. Raises ProcessNotFound when ``pid`` is gone."""
        ...
