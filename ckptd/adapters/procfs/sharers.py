"""Which other processes write a job's files: one pass over ``/proc/*/fd`` and
``/proc/*/maps`` (``JobFiles.shared``).

A file is matched by identity (``st_dev``, ``st_ino``), never by path: a process that opened
it under another name (a bind mount, a container's root, a hard link) is found, one that
holds another file at the same path is not. A descriptor counts when it is open for writing
(``O_WRONLY``/``O_RDWR``), a mapping when it is shared and writable.

Cost: one ``readlink`` per descriptor of every process (only those naming a path are
``stat``-ed), one read of each process's ``maps``; a few milliseconds for a node of a few
hundred processes, whatever the number of files asked about.

Not seen: a process that wrote the file and closed it (or exited) before the scan; a
process in another pid namespace whose /proc this daemon does not see.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from ckptd.adapters.procfs.node import fd_flags

Identity = tuple[int, int]
_WRITING = (os.O_WRONLY, os.O_RDWR)


def _pids(proc: Path) -> Iterator[int]:
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def _command(proc: Path, pid: int) -> str:
    """Its ``comm``, every character that does not print (the process chose it) a ``?``:
    it goes into one-line messages."""
    try:
        comm = (proc / str(pid) / "comm").read_text(errors="replace").rstrip("\n")
    except OSError:
        return "?"
    return "".join(c if c.isprintable() else "?" for c in comm) or "?"


def _writes(proc: Path, pid: int, wanted: Collection[Identity]) -> set[Identity]:
    """Of ``wanted``, what process ``pid`` holds open for writing or maps shared-writable."""
    found: set[Identity] = set()
    base = proc / str(pid)
    fd_dir = base / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    for name in fds:
        try:
            if not os.readlink(fd_dir / name).startswith("/"):
                continue  # pipes, sockets, anonymous inodes
            st = os.stat(fd_dir / name)
            ident = (st.st_dev, st.st_ino)
            if ident in wanted and ident not in found and (
                    fd_flags(base / "fdinfo" / name) & os.O_ACCMODE in _WRITING):
                found.add(ident)
        except OSError:
            continue
    try:
        lines = (base / "maps").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[1][1] != "w" or parts[1][3] != "s":
            continue
        try:
            st = os.stat(base / "map_files" / parts[0])
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found.add((st.st_dev, st.st_ino))
    return found


def writers_of(
    proc: Path, wanted: Mapping[Identity, str], outside: Collection[int]
) -> dict[str, list[tuple[int, str]]]:
    """Path (``wanted``'s value) -> [(pid, command)] of every process but ``outside`` and
    this one that writes the file of that identity; files nobody else writes left out."""
    if not wanted:
        return {}
    skip = {*outside, os.getpid()}
    found: dict[str, list[tuple[int, str]]] = {}
    for pid in sorted(_pids(proc)):
        if pid in skip:
            continue
        hits = _writes(proc, pid, wanted)
        if hits:
            command = _command(proc, pid)
            for ident in sorted(hits):
                found.setdefault(wanted[ident], []).append((pid, command))
    return found
