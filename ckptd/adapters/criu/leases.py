"""Whether a process tree holds a file lease (``F_SETLEASE``), so that CRIU's dump must not
open the leased files itself.

CRIU's default file validation (``build-id``) opens every regular file of 5 bytes or more
again (``/proc/self/fd/N``) to read an ELF build-id: on a file the tree holds a write lease
on, that open breaks the lease and waits out the kernel's lease-break time (45 s by default)
inside the frozen window, the holder being frozen. A tree that holds a lease is dumped with
``file-validation filesize`` (CRIU checks the files by size at the restore): nothing reopens
the leased file, and the lease is dumped and kept as CRIU's ``file_locks`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

VALIDATION_BY_SIZE = "file-validation filesize\n"
"""CRIU's RPC configuration file line for a tree that holds a lease."""


def _tree(pid: int, proc: Path) -> Iterator[int]:
    """``pid`` and its descendants, through each thread's ``children`` list."""
    seen: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        try:
            tasks = os.listdir(proc / str(current) / "task")
        except OSError:
            continue
        for task in tasks:
            try:
                text = (proc / str(current) / "task" / task / "children").read_text()
            except OSError:
                continue
            todo.extend(int(child) for child in text.split())


def holds_lease(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether a process of the tree at ``pid`` holds a lease on a file: a ``lock:`` line of
    kind ``LEASE`` in one of its descriptors' fdinfo."""
    for member in _tree(pid, proc):
        fdinfo = proc / str(member) / "fdinfo"
        try:
            names = os.listdir(fdinfo)
        except OSError:
            continue
        for name in names:
            try:
                with open(fdinfo / name, encoding="ascii", errors="replace") as lines:
                    if any(line.startswith("lock:") and " LEASE " in line for line in lines):
                        return True
            except OSError:
                continue
    return False
