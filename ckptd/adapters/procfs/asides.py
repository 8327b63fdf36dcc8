"""The copies a restore kept aside (``<name>.ckptd-<restore id>``), each as its restore recorded
it (``core.ports.asides``): examined and removed — by retention or on request — only while
the name still holds that very file (``st_dev``, ``st_ino``, owner; a regular file with one
link), fd-relative in the file's held directory, like every root file operation on
user-controlled paths (``safefs``, docs/adr/0017).

Invariants: a file merely named like a copy (planted by another user, in a sticky shared
directory too) or put at a recorded copy's name since is never removed; nothing is reached
through a link.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ckptd.adapters.procfs.safefs import Located, Root

THERE = "there"
GONE = "gone"
CHANGED = "changed"


@dataclass(frozen=True)
class Found:
    """What is at a recorded aside's name now: ``THERE`` (the very copy: same ``st_dev``,
    ``st_ino`` and owner, a regular file with one link), ``GONE`` (nothing), ``CHANGED``
    (another file, or a link, a directory...), with what it is (None when gone)."""

    state: str
    st: os.stat_result | None = None


def examine(root: Root, path: str, dev: int, ino: int, uid: int) -> Found:
    """What is at ``path`` now against the copy recorded as (``dev``, ``ino``, ``uid``);
    reached fd-relative, no link followed (a link on the way: UnsafePath)."""
    with root.locate(path) as loc:
        return _found(loc, dev, ino, uid)


def remove_recorded(root: Root, path: str, dev: int, ino: int, uid: int) -> str:
    """Remove the copy recorded at ``path`` as (``dev``, ``ino``, ``uid``), only while that
    very file is there: "" when removed, else why not (a line: gone, or another file has its
    name). fd-relative in the held directory, no link followed; the check and the unlink
    are of the same name in the same held directory (a file renamed onto that name in the
    instant between needs write access to the directory, and a sticky one lets no one
    replace a file they do not own)."""
    with root.locate(path) as loc:
        found = _found(loc, dev, ino, uid)
        if found.state == GONE:
            return "it is gone already"
        if found.state == CHANGED:
            return _changed(found.st, uid)
        try:
            os.unlink(loc.name, dir_fd=loc.dirfd)
        except FileNotFoundError:
            return "it is gone already"
        return ""


def _found(loc: Located, dev: int, ino: int, uid: int) -> Found:
    try:
        st = os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return Found(GONE)
    same = ((st.st_dev, st.st_ino) == (dev, ino) and st.st_uid == uid
            and stat.S_ISREG(st.st_mode) and st.st_nlink == 1)
    return Found(THERE if same else CHANGED, st)


def _changed(st: os.stat_result | None, uid: int) -> str:
    if st is None or not stat.S_ISREG(st.st_mode):
        return "another file than the copy kept has its name now (not a regular file)"
    if st.st_uid != uid:
        return (f"another file than the copy kept has its name now (owned by uid "
                f"{st.st_uid}, the copy by uid {uid}): left alone")
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links now: left alone"
    return "another file than the copy kept has its name now: left alone"
