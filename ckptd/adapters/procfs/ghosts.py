"""Ghost files of a tree from /proc: deleted files its processes hold open
(``/proc/PID/fd``) or mapped (``/proc/PID/map_files``) with no link left, each once.

What is left out is not a file CRIU dumps as a ghost: memfds (``/memfd:``), SysV and
anonymous shared memory (``/SYSV…``, ``/dev/zero``), a deleted file that still has a link
(CRIU links it back, copying nothing), anything but a regular file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptd.core.ports.files import GhostFile
from ckptd.domain import ProcessFact

DELETED = " (deleted)"
_NOT_FILES = ("/memfd:", "/SYSV", "/dev/zero", "/dmabuf:")


def ghost_files(proc: Path, tree: Sequence[ProcessFact]) -> tuple[GhostFile, ...]:
    """Every ghost file of ``tree``, sorted by path; sizes are allocated bytes."""
    found: dict[tuple[int, int], GhostFile] = {}
    for process in tree:
        for source, shown in _held(proc / str(process.pid)):
            if not shown.endswith(DELETED):
                continue
            path = shown[: -len(DELETED)]
            if not path.startswith("/") or path.startswith(_NOT_FILES):
                continue
            try:
                st = os.stat(source)  # the object itself, through the process's own link
            except OSError:
                continue  # closed or unmapped meanwhile
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 0:
                found.setdefault((st.st_dev, st.st_ino),
                                 GhostFile(path, st.st_blocks * 512, process.pid))
    return tuple(sorted(found.values(), key=lambda g: (g.path, g.pid)))


def relinked_files(proc: Path, tree: Sequence[ProcessFact]) -> tuple[str, ...]:
    """The paths (as /proc shows them, ``(deleted)`` cut) of every deleted file ``tree``
    holds that still has a link elsewhere: CRIU's dump links each back beside its old path
    as ``link_remap.N``, by path, and its restore opens and removes it there. Sorted."""
    found: set[str] = set()
    for process in tree:
        for source, shown in _held(proc / str(process.pid)):
            path = shown[: -len(DELETED)] if shown.endswith(DELETED) else ""
            if not path.startswith("/") or path.startswith(_NOT_FILES):
                continue
            try:
                st = os.stat(source)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 0:
                found.add(path)
    return tuple(sorted(found))


def _held(base: Path) -> Iterator[tuple[Path, str]]:
    """(where to stat it, the path /proc shows) of each descriptor and file mapping."""
    fd_dir = base / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        names = []
    for name in names:
        try:
            yield fd_dir / name, os.readlink(fd_dir / name)
        except OSError:
            continue
    try:
        lines = (base / "maps").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].endswith(DELETED):
            yield base / "map_files" / parts[0], parts[5]
