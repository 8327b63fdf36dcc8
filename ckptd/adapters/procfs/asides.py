"""The copies a restore kept aside (``<name>.ckptd-<restore id>``): listed, and removed by
retention or on request — fd-relative in the file's held directory, like every root file
operation on user-controlled paths (``safefs``, docs/adr/0017).

Invariants: only complete asides are considered (a ``.part``/``.new`` temporary belongs to a
put-back in flight or to recovery); only regular files with one link; with ``owner`` given,
only files of that uid; nothing is reached through a link. On request (``ckptctl asides``)
only a copy a restore recorded (``core.ports.asides``) is removed, and only while its name
holds that very file (``examine``, ``remove_recorded``): never a file merely named like one.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

from ckptd.adapters.procfs.putback import ASIDE_MARK as MARK
from ckptd.adapters.procfs.putback import NEW, PART, entries
from ckptd.adapters.procfs.safefs import Located, Root

_TEMPORARY = (PART, NEW)


@dataclass(frozen=True)
class Aside:
    """One copy kept aside: its path, size, when it was made (mtime, s) and owner."""

    path: str
    size: int
    made: float
    uid: int


def list_asides(root: Root, path: str, owner: int | None = None) -> list[Aside]:
    """The complete asides of ``path``, oldest first. A missing directory: none."""
    try:
        with root.locate(path) as loc:
            return _asides(root, loc, owner)
    except FileNotFoundError:
        return []


def prune_asides(
    root: Root, path: str, *, keep: int, max_age_s: float, now: float, owner: int | None = None
) -> list[str]:
    """Remove the asides of ``path`` beyond the ``keep`` newest, and those older than
    ``max_age_s`` (0: no age limit); the paths removed."""
    try:
        with root.locate(path) as loc:
            found = _asides(root, loc, owner)
            doomed = found[: max(0, len(found) - keep)]
            if max_age_s > 0:
                doomed += [a for a in found[len(doomed):] if now - a.made > max_age_s]
            return [a.path for a in doomed if _remove(loc, a)]
    except FileNotFoundError:
        return []


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


def _asides(root: Root, loc: Located, owner: int | None, any_file: bool = False
            ) -> list[Aside]:
    """Asides in ``loc``'s directory: of the file ``loc.name``, or (``any_file``) of any."""
    directory = loc.path.rsplit("/", 1)[0]

    def wanted(name: str) -> bool:
        ours = MARK in name if any_file else name.startswith(loc.name + MARK)
        return ours and not name.endswith(_TEMPORARY)

    out: list[Aside] = []
    for name, st in entries(root, loc, wanted).items():
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            continue
        if owner is not None and st.st_uid != owner:
            continue
        out.append(Aside(f"{directory}/{name}", st.st_size, st.st_mtime, st.st_uid))
    return sorted(out, key=lambda a: (a.made, a.path))


def _remove(loc: Located, aside: Aside) -> bool:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside.path.rsplit("/", 1)[1], dir_fd=loc.dirfd)
        return True
    return False
