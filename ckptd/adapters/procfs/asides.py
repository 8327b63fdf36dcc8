"""The copies a restore kept aside (``<name>.ckptd-<restore id>``): listed, and removed by
retention or on request — fd-relative in the file's held directory, like every root file
operation on user-controlled paths (``safefs``, docs/adr/0017).

Invariants: only complete asides are considered (a ``.part``/``.new`` temporary belongs to a
put-back in flight or to recovery); only regular files with one link; with ``owner`` given,
only files of that uid; nothing is reached through a link.
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


def remove_aside(root: Root, aside_path: str, owner: int | None = None) -> bool:
    """Remove one aside (its name must be an aside's); False when it is not there."""
    with root.locate(aside_path) as loc:
        matches = [a for a in _asides(root, loc, owner, any_file=True)
                   if a.path == aside_path]
        return bool(matches) and _remove(loc, matches[0])


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
