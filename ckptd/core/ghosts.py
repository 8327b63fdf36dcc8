"""Ghost files bounded per dump and per uid, not only per file (issue 33, point 4).

A ghost file — one a tree holds open or mapped after deleting it, PyTorch's shared memory —
is copied whole into the dump's staging (RAM when it fits: the RAM every tenant's
DataLoader and NCCL share). ``ghost_limit`` bounds each file (CRIU refuses one over it);
here, before anything is frozen:

- one dump's ghost files together are bounded by ``ghost_total_limit`` (``refuse_over_total``);
- the ghost files of one uid's trees in the dumps this daemon runs at once are bounded by
  ``ghost_uid_limit`` (``GhostBudget``: taken at inspect, given back when the dump ends);
- their bytes count in the choice of RAM or disk staging (``CheckpointStore.begin``).

Sizes are allocated bytes (what CRIU copies and compares with its own limit), read from
/proc while the tree runs: a tree that grows its ghosts between inspect and the freeze is
still bounded per file by CRIU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ckptd.core.config import CoreConfig
from ckptd.core.ports.criu import CriuRelink
from ckptd.core.ports.files import GhostFile
from ckptd.errors import TargetRefused, TooManyRequests


def _fmt(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} B"


def counted(ghosts: Sequence[GhostFile], config: CoreConfig) -> tuple[GhostFile, ...]:
    """The ghost files a dump would take: those within ``ghost_limit`` (one over it is
    CRIU's to refuse, naming that setting), largest first."""
    return tuple(sorted((g for g in ghosts if g.size <= config.ghost_limit),
                        key=lambda g: (-g.size, g.path)))


def refuse_over_total(ghosts: Sequence[GhostFile], config: CoreConfig, pid: int) -> int:
    """The bytes of ``ghosts`` (``counted``) a dump of ``pid`` takes; raises TargetRefused
    (one line naming the largest files, the total, the limit and ``ghost_total_limit``)
    when they are over it."""
    taken = counted(ghosts, config)
    total = sum(g.size for g in taken)
    if total > config.ghost_total_limit:
        named = ", ".join(f"{g.path} ({_fmt(g.size)})" for g in taken[:3])
        more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
        raise TargetRefused(
            f"the tree of pid {pid} holds {len(taken)} deleted files (ghost files: shared "
            f"memory such as PyTorch's) of {_fmt(total)} together, over the "
            f"{_fmt(config.ghost_total_limit)} a dump takes (ghost_total_limit): {named}{more}",
            hint="raise ghost_total_limit in the daemon's configuration (the files are staged "
            "at once, in RAM when they fit), or let the job free its shared memory first",
            pid=pid,
        )
    return total


def refuse_unsafe_relinks(problems: Sequence[str], pid: int) -> None:
    """Raises TargetRefused (before anything freezes) for the first of ``problems``
    (``JobFiles.relink_problems``): CRIU links a deleted file that still has a link elsewhere
    back beside its old path, by path, as root — only where root alone can change the
    directories (docs/adr/0017)."""
    if problems:
        raise TargetRefused(
            f"cannot checkpoint pid {pid}: it holds {problems[0]}",
            hint="close that file, or keep such files in a directory only root can change "
                 "(/tmp, /dev/shm)", pid=pid)


def refuse_unlinked_remaps(relinks: Sequence[CriuRelink], pid: int) -> None:
    """Raises TargetRefused (CRIU has dumped; nothing is committed, the tree runs on) for
    the first link-remap file linked as nothing else in its own directory: the object CRIU
    linked back would be gone from the node once its link-remap file is, and no restore of
    the checkpoint could find it (a checkpoint holds everything its restore needs)."""
    for relink in relinks:
        if not relink.linked_as:
            raise TargetRefused(
                f"cannot checkpoint pid {pid}: it holds the deleted file {relink.deleted}, "
                f"still linked elsewhere but under no other name in its directory; CRIU "
                f"linked it back as {relink.remap}, which no restore would find once the "
                "dump ends: nothing was committed, the tree runs on",
                hint="close that file before the checkpoint, or keep its other name in the "
                     "same directory", pid=pid)


class GhostBudget:
    """The ghost bytes of the dumps under way, by the uid owning each tree. Thread-safe.

    Invariant: a uid's taken bytes never exceed ``limit`` (a single dump over it alone is
    refused too); every ``take`` is matched by a ``give_back`` of its key when its dump ends,
    however it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[str, tuple[int, int]] = {}

    def take(self, key: str, uid: int, size: int, limit: int, pid: int) -> None:
        """Count ``size`` bytes of ``uid`` for dump ``key`` (replacing what it took before);
        raises TooManyRequests naming ``ghost_uid_limit`` when that takes ``uid`` over
        ``limit``, nothing counted then."""
        with self._lock:
            others = sum(s for k, (u, s) in self._taken.items() if u == uid and k != key)
            if size and others + size > limit:
                raise TooManyRequests(
                    f"the tree of pid {pid} holds ghost files (deleted shared memory) of "
                    f"{_fmt(size)}, and dumps of uid {uid}'s trees under way hold "
                    f"{_fmt(others)}: over the {_fmt(limit)} of one uid's at once "
                    "(ghost_uid_limit)",
                    hint="wait for that uid's other dumps to end, or raise ghost_uid_limit in "
                    "the daemon's configuration",
                    pid=pid,
                )
            if size:
                self._taken[key] = (uid, size)
            else:
                self._taken.pop(key, None)

    def give_back(self, key: str) -> None:
        with self._lock:
            self._taken.pop(key, None)

    def taken(self, uid: int) -> int:
        with self._lock:
            return sum(s for u, s in self._taken.values() if u == uid)
