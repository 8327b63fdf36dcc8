"""Paths of another process's root file system (a container's), reached from the node.

``/proc/PID/root`` is the root directory of process PID: ``/proc/PID/root/data/log`` is the
container's ``/data/log``. A symbolic link met on the way would be resolved against the
*daemon's* root if absolute (``/data -> /etc`` inside the container would reach the node's
``/etc``), so every component below the root is checked not to be one; a path that has one
is refused (``ContainerPathError``). The final component is the caller's business (opened
``O_NOFOLLOW``, or ``lstat``-ed).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class ContainerPathError(OSError):
    """A path of a container's file system that cannot be reached safely from the node."""


def process_root(proc: Path, pid: int) -> Path:
    """The root directory of ``pid`` as a node path (``/proc/PID/root``)."""
    return proc / str(pid) / "root"


def same_root(proc: Path, pid: int) -> bool:
    """Whether ``pid`` sees the daemon's root and mount namespace (no view is needed)."""
    try:
        theirs = os.stat(proc / str(pid) / "root")
        ours = os.stat("/")
        mnt_theirs = os.stat(proc / str(pid) / "ns" / "mnt").st_ino
        mnt_ours = os.stat(proc / "self" / "ns" / "mnt").st_ino
    except OSError:
        return True  # gone or unreadable: callers then fail on the files themselves
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino) and mnt_theirs == mnt_ours


def in_root(root: Path, path: str) -> str:
    """``path`` (absolute, as the container sees it) as a node path under ``root``; raises
    ContainerPathError when a directory on the way is a symbolic link."""
    if not path.startswith("/"):
        raise ContainerPathError(f"{path!r} is not an absolute path")
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise ContainerPathError(f"{path!r} has a '..' component")
    for i in range(len(parts) - 1):
        inside = "/" + "/".join(parts[: i + 1])
        try:
            mode = os.lstat(f"{root}{inside}").st_mode
        except FileNotFoundError:
            break  # the rest is missing: the caller's open/stat says so
        if stat.S_ISLNK(mode):
            raise ContainerPathError(
                f"{inside} is a symbolic link in the container's file system (on the way to "
                f"{path}): ckptd does not follow links there")
    return f"{root}{path}" if parts else str(root)
