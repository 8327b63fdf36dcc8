"""``FakeCgroups``: a ``Cgroups`` over a dict pid -> cgroup."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptd.core.ports import MemoryLimit
from ckptd.domain import PidState
from ckptd.errors import CgroupUnavailable, ProcessNotFound
from ckptd.testing._processes import FakeProcessTable

if TYPE_CHECKING:
    from ckptd.core.ports import Cgroups


def _parents(cgroup: str) -> list[str]:
    """``/a/b`` -> ``["/", "/a", "/a/b"]``."""
    parts = [p for p in cgroup.split("/") if p]
    return ["/", *("/" + "/".join(parts[: i + 1]) for i in range(len(parts)))]


class FakeCgroups:
    """A ``Cgroups`` (see ``ckptd.core.ports``) in memory, mirroring ``CgroupFs``:

    - ``where`` maps a pid to its cgroup; a process never placed is in ``default`` (the
      daemon's cgroup, where CRIU starts);
    - ``cgroups`` holds the cgroups that exist: ``/``, ``default`` and their parents at first;
    - a process exists while it is in ``spawned`` (processes of no table: CRIU's, see
      ``FakeCriu``) or, with ``processes``, not free in that table (without one, every pid
      exists); ``cgroup_of`` and ``move`` of one that does not raise ProcessNotFound, and
      ``cgroup_of`` of a pid in ``outside`` raises CgroupUnavailable (a cgroup outside the
      daemon's namespace);
    - ``move`` creates the cgroup and its parents with ``create``; a missing cgroup, or one
      in ``busy`` (controllers enabled for its children: cgroup v2 puts no process there),
      raises CgroupUnavailable; so does ``fail_move`` (an exception) once set, for every
      move into a cgroup in ``fail_into`` (empty: every move). Processes moved before a
      failure stay moved. Each move is recorded in ``moves`` as ``(pids, cgroup)``;
    - ``remove_empty(parent)`` removes the children of ``parent`` that hold no live process
      (zombies do not count) and no cgroup;
    - ``fork(child, parent)``: the new process is born in its parent's cgroup (``born_in``,
      when set, overrides that, as if something moved it at once).

    With ``events``, appends ``"cgroups.move <cgroup> <pid> ..."`` and ``"cgroups.removed
    <cgroup>"``. Thread-safe.
    """

    def __init__(
        self,
        processes: FakeProcessTable | None = None,
        *,
        default: str = "/system.slice/ckptd.service",
        events: list[str] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.processes = processes
        self.default = default
        self.events = events
        self.where: dict[int, str] = {}
        self.cgroups: set[str] = set(_parents(default))
        self.busy: set[str] = set()
        self.outside: set[int] = set()
        self.spawned: set[int] = set()
        self.moves: list[tuple[tuple[int, ...], str]] = []
        self.fail_move: Exception | None = None
        self.fail_into: set[str] = set()
        self.born_in: str | None = None
        self.limits: dict[str, tuple[int, int]] = {}
        """Memory limits by cgroup: ``(limit, usage)`` in bytes (``memory_limit``)."""

    # ---- set-up helpers ----------------------------------------------------------------------

    def add(self, cgroup: str) -> None:
        """Make ``cgroup`` (and its parents) exist."""
        with self._lock:
            self.cgroups.update(_parents(cgroup))

    def place(self, pid: int, cgroup: str) -> None:
        """Put ``pid`` in ``cgroup`` (created if missing), recording no move."""
        with self._lock:
            self.add(cgroup)
            self.where[pid] = cgroup

    def spawn(self, pid: int, cgroup: str | None = None) -> None:
        """A process of no table (CRIU's), in ``cgroup`` (default: ``default``)."""
        with self._lock:
            self.spawned.add(pid)
            self.place(pid, cgroup or self.default)

    def exit(self, pid: int) -> None:
        with self._lock:
            self.spawned.discard(pid)
            self.where.pop(pid, None)

    def fork(self, child: int, parent: int) -> None:
        with self._lock:
            self.where[child] = self.born_in or self.where.get(parent, self.default)

    def members(self, cgroup: str) -> list[int]:
        """The live processes in ``cgroup``."""
        with self._lock:
            pids = set(self.where) | set(self.processes.processes if self.processes else ())
            return sorted(p for p in pids
                          if self.where.get(p, self.default) == cgroup and self._live(p))

    # ---- the port ------------------------------------------------------------------------

    def cgroup_of(self, pid: int) -> str:
        with self._lock:
            if not self._exists(pid):
                raise ProcessNotFound(f"process {pid} is gone", pid=pid)
            if pid in self.outside:
                raise CgroupUnavailable(
                    f"the cgroup of process {pid} is outside the daemon's cgroup namespace",
                    pid=pid)
            return self.where.get(pid, self.default)

    def move(self, pids: Sequence[int], cgroup: str, *, create: bool = False) -> None:
        with self._lock:
            if self.fail_move is not None and (not self.fail_into or cgroup in self.fail_into):
                raise self.fail_move
            if create:
                self.add(cgroup)
            if cgroup not in self.cgroups:
                raise CgroupUnavailable(f"cgroup {cgroup} does not exist")
            if cgroup in self.busy:
                raise CgroupUnavailable(
                    f"cgroup {cgroup} takes no processes: controllers are enabled for its "
                    "child cgroups")
            for pid in pids:
                if not self._exists(pid):
                    raise ProcessNotFound(f"process {pid} is gone", pid=pid)
                self.where[pid] = cgroup
            self.moves.append((tuple(pids), cgroup))
            self._event(f"cgroups.move {cgroup} " + " ".join(map(str, pids)))

    def procs(self, cgroup: str) -> tuple[int, ...]:
        with self._lock:
            if cgroup not in self.cgroups:
                raise CgroupUnavailable(f"cgroup {cgroup} does not exist")
            return tuple(self.members(cgroup))

    def memory_limit(self, pid: int) -> MemoryLimit | None:
        """``limits[cgroup]`` (limit, usage) of ``pid``'s cgroup or its nearest limited
        ancestor (the tightest); None when none is set."""
        with self._lock:
            cgroup = self.cgroup_of(pid)
            found = [MemoryLimit(c, *self.limits[c]) for c in _parents(cgroup)
                     if c in self.limits]
            return min(found, key=lambda m: m.free) if found else None

    def remove_empty(self, parent: str) -> list[str]:
        with self._lock:
            prefix = parent.rstrip("/") + "/"
            children = [c for c in self.cgroups
                        if c.startswith(prefix) and "/" not in c[len(prefix):]]
            removed = []
            for child in sorted(children):
                nested = any(c.startswith(child + "/") for c in self.cgroups)
                if nested or child == self.default or self.members(child):
                    continue
                self.cgroups.discard(child)
                removed.append(child)
                self._event(f"cgroups.removed {child}")
            return removed

    # ---- internals -------------------------------------------------------------------------

    def _exists(self, pid: int) -> bool:
        if pid in self.spawned or self.processes is None:
            return True
        return self.processes.status(pid).state is not PidState.FREE

    def _live(self, pid: int) -> bool:
        if pid in self.spawned or self.processes is None:
            return True
        return self.processes.status(pid).state not in (PidState.FREE, PidState.ZOMBIE)

    def _event(self, text: str) -> None:
        if self.events is not None:
            self.events.append(text)


if TYPE_CHECKING:

    def _is_cgroups(fake: FakeCgroups) -> Cgroups:
        return fake
