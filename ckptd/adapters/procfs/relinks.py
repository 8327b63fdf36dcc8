"""CRIU's link-remap files, made self-contained: what each is linked as, recorded at the
dump; removed once the dump no longer needs it; made again at the restore (docs/adr/0028).

A deleted file a tree holds that is still linked elsewhere (a spawn-context
``multiprocessing`` semaphore: glibc maps it through a temporary name it unlinks, the
semaphore stays ``/dev/shm/sem.mp-*``) is dumped by CRIU as a hard link ``link_remap.N``
beside its old name; CRIU's restore links that back at the deleted name, opens it and removes
both. The object must stay the one the other name holds (the spawned process opens
``sem.mp-*`` by that name: a copy would be a semaphore of its own). CRIU leaves the link on
disk after a dump that kills (where the next dump of another job fails on it, ``File
exists``), and removes it after a leave-running one (whose restores then all fail). So:

- at the dump (CRIU at post-dump: every link still there) ``linked_as`` finds, for each
  link-remap file of the images, the other name of the same object in its own directory;
- ``remove`` unlinks a link-remap file only while it is the very object its ``linked_as``
  names (never another file put at that name);
- at the restore ``make`` links each missing link-remap file again from its ``linked_as``,
  through the object's descriptor (no path resolved twice), and ``remove`` unlinks what
  ``make`` made whatever the restore's outcome.

Every operation is fd-relative from a pinned ``Root``, no link followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence

from ckptd.adapters.procfs.safefs import Located, Root, UnsafePath
from ckptd.core.ports.criu import CriuRelink

_REMAP_PREFIX = "link_remap."


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def linked_as(root: Root, relinks: Iterable[CriuRelink]) -> tuple[CriuRelink, ...]:
    """``relinks`` with ``linked_as`` set where the link-remap file's object has another
    name in its directory (the first, sorted, that is not a link-remap file); left "" where
    it has none, or the link-remap file is not there."""
    found: list[CriuRelink] = []
    for relink in relinks:
        other = ""
        with contextlib.suppress(OSError), root.locate(relink.remap) as loc:
            st = os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                other = _other_name(root, loc, (st.st_dev, st.st_ino))
        if other:
            other = relink.remap.rsplit("/", 1)[0] + "/" + other
        found.append(relink._replace(linked_as=other))
    return tuple(found)


def _other_name(root: Root, loc: Located, identity: tuple[int, int]) -> str:
    listing = root.open_in(loc, os.O_RDONLY | os.O_DIRECTORY, name=".")
    try:
        for entry in sorted(os.listdir(listing)):
            if entry == loc.name or entry.startswith(_REMAP_PREFIX):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(entry, dir_fd=listing, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == identity and stat.S_ISREG(st.st_mode):
                    return entry
    finally:
        os.close(listing)
    return ""


def remove(root: Root, relinks: Iterable[CriuRelink]) -> None:
    """Unlink each link-remap file that is the very object its ``linked_as`` names (a
    missing one, or one that is another object, is left)."""
    for relink in relinks:
        if not relink.linked_as:
            continue
        with contextlib.suppress(OSError), root.locate(relink.remap) as loc:
            st = os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
            other = os.stat(_name(relink.linked_as), dir_fd=loc.dirfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (other.st_dev,
                                                                       other.st_ino):
                os.unlink(loc.name, dir_fd=loc.dirfd)


def make(root: Root, relinks: Sequence[CriuRelink]) -> tuple[CriuRelink, ...]:
    """Each missing link-remap file of ``relinks`` linked again from its ``linked_as``;
    returns those made (for ``remove``). Raises OSError saying which file CRIU would need
    and why it cannot be made (what was made is removed first)."""
    made: list[CriuRelink] = []
    try:
        for relink in relinks:
            if _make_one(root, relink):
                made.append(relink)
    except BaseException:
        remove(root, made)
        raise
    return tuple(made)


def _make_one(root: Root, relink: CriuRelink) -> bool:
    with root.locate(relink.remap) as loc:
        try:
            os.stat(loc.name, dir_fd=loc.dirfd, follow_symlinks=False)
            return False  # still there (a dump by an older ckptd): CRIU opens it
        except FileNotFoundError:
            pass
        if not relink.linked_as:
            raise UnsafePath(errno.ENOENT, (
                f"CRIU needs {root.label}{relink.remap} to bring back the deleted file "
                f"{relink.deleted}, and it is gone: the checkpoint does not record which "
                "file it was linked as"))
        try:
            fd = root.open_in(loc, os.O_PATH, name=_name(relink.linked_as))
        except FileNotFoundError as exc:
            raise UnsafePath(errno.ENOENT, (
                f"{root.label}{relink.linked_as} is gone, and the job held it (as the deleted "
                f"{relink.deleted}) at the checkpoint: a restore links that very file back, "
                "so it must exist (a named semaphore's file is removed when its job ends)"
            )) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePath(errno.EINVAL, f"{root.label}{relink.linked_as} is not a "
                                 "regular file: ckptd links back only the job's own files")
            os.link(f"/proc/self/fd/{fd}", loc.name, dst_dir_fd=loc.dirfd,
                    follow_symlinks=True)
        finally:
            os.close(fd)
    return True
