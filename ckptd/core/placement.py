"""Where a restored tree lives: its cgroup, chosen before anything exists (docs/adr/0010).

The restore recipe (``core.restore``) asks three things, in its order:

    choose        before CRIU: the caller's cgroup; one of the tree's own
                  (``<jobs_cgroup>/<name or id>-<op>``) when the caller is the daemon itself,
                  is unknown (pid 0: outside the daemon's pid namespace) or is in the
                  daemon's cgroup; ``jobs_cgroup`` empty: the daemon's. Into a container:
                  its init's.
    place_criu    CRIU's process exists and has created nothing: it is moved there (the
                  tree is then born there, its memory charged there)
    check_placed  at post-restore, before the tree runs: a process not born there is moved
                  there (raises, so CRIU undoes the restore, when it cannot be)

Invariants: with a ``Cgroups`` port, no process of the restored tree ever runs outside the
cgroup chosen for it; a caller that is gone when its cgroup is asked for is refused
(CgroupUnavailable), nothing having been touched; without a ``Cgroups`` port (a node without
cgroup v2) nothing is placed and CRIU restores the tree's own cgroups.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ckptd.core.callers import caller_process
from ckptd.core.config import CoreConfig
from ckptd.core.intocontainer import CallerContainer
from ckptd.core.ports import Cgroups, ProcessLookup
from ckptd.domain import Caller, CheckpointRecord
from ckptd.errors import CgroupUnavailable, ProcessNotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeCgroup:
    """The cgroup chosen for a restored tree ("" when ckptd places nothing)."""

    path: str = ""
    create: bool = False
    """``path`` is one of the tree's own, created for it."""


class CgroupPlacement:
    """The three placement calls of a restore (module docstring). Thread-safe: no state of
    its own beyond its ports."""

    def __init__(self, cgroups: Cgroups | None, processes: ProcessLookup,
                 config: CoreConfig) -> None:
        self._cgroups = cgroups
        self._processes = processes
        self._config = config

    def choose(self, caller: Caller, record: CheckpointRecord, op_id: str,
               into: CallerContainer | None) -> TreeCgroup:
        """The caller's cgroup; a cgroup of its own when the caller is the daemon itself,
        is unknown, or is in the daemon's cgroup. ``jobs_cgroup`` empty: the daemon's."""
        if self._cgroups is None:
            return TreeCgroup()
        if into is not None:  # CRIU is run in the container's cgroups (every hierarchy)
            return TreeCgroup(self._cgroup_of(into.init,
                                              f"the container's init (pid {into.init})"))
        daemon_pid = self._config.daemon_pid
        daemon = self._cgroup_of(daemon_pid, f"the daemon (pid {daemon_pid})")
        pid = caller.pid or 0
        if pid > 0 and pid != daemon_pid:
            with caller_process(self._processes, caller, "the cgroup of its restore was chosen"):
                theirs = self._cgroup_of(pid, f"the caller (pid {pid})")
            if not within(theirs, daemon):
                log.info("restore %s: into the caller's cgroup %s", op_id, theirs)
                return TreeCgroup(theirs)
        base = self._config.jobs_cgroup.rstrip("/")
        if not base:
            return TreeCgroup(daemon)
        own = TreeCgroup(f"{base}/{leaf_name(record.name or record.id, op_id)}", create=True)
        log.info("restore %s: into a cgroup of its own, %s", op_id, own.path)
        return own

    def place_criu(self, where: TreeCgroup, criu_pid: int,
                   into: CallerContainer | None) -> None:
        """CRIU's process into the tree's cgroup, before it creates anything."""
        if not where.path or self._cgroups is None or into is not None:
            return  # (into a container: CRIU's entry moves itself into its cgroups)
        if where.create:  # leftovers of restores whose trees have ended
            self._cgroups.remove_empty(where.path.rsplit("/", 1)[0] or "/")
        self._cgroups.move((criu_pid,), where.path, create=where.create)

    def check_placed(self, where: TreeCgroup, pids: Iterable[int], op_id: str) -> None:
        """Every one of ``pids`` (the tree, held, not yet run) is in the tree's cgroup; one
        that is not is moved there (raises when it cannot be)."""
        if not where.path or self._cgroups is None:
            return
        astray = []
        for pid in pids:
            with contextlib.suppress(ProcessNotFound):
                if self._cgroups.cgroup_of(pid) != where.path:
                    astray.append(pid)
        if astray:
            log.warning("restore %s: pids %s were not born in %s; moving them", op_id,
                        astray, where.path)
            self._cgroups.move(astray, where.path)

    def _cgroup_of(self, pid: int, who: str) -> str:
        assert self._cgroups is not None
        try:
            return self._cgroups.cgroup_of(pid)
        except ProcessNotFound as exc:
            raise CgroupUnavailable(f"{who} is gone: its cgroup cannot be told",
                                    hint="ask again from a running process") from exc


_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]")


def leaf_name(label: str, op_id: str) -> str:
    """The name of a restored tree's own cgroup: its checkpoint's name (or id) and the
    restore's operation id (unique), with what a cgroup name should not hold replaced."""
    return f"{_UNSAFE.sub('_', label)}-{op_id}"


def within(cgroup: str, ancestor: str) -> bool:
    """``cgroup`` is ``ancestor`` or below it (the root contains only itself here: a caller
    in any other cgroup is not "in the daemon's" because the daemon runs at the root)."""
    if cgroup == ancestor:
        return True
    return ancestor != "/" and cgroup.startswith(ancestor.rstrip("/") + "/")
