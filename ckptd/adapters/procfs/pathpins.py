"""The objects CRIU reopens by path for a restore, pinned before it runs and compared after.

CRIU opens what a restored task held — files open or mapped, its executable, working and
root directories, named FIFOs, link-remap files — by the path its images name, as root,
following links; and creates ghost files and unix sockets by path. A user owning a directory
on such a path could swap it (``renameat2(RENAME_EXCHANGE)`` with a link to a root-only
directory) while CRIU resolves it. So (docs/adr/0017):

- before CRIU runs, every path it will open is reached from a pinned root with no link
  followed (``safefs.Root``) and held as an ``O_PATH`` descriptor: its identity
  (``st_dev``, ``st_ino``) cannot be reused while it is held; a link on the way refuses the
  restore;
- every directory CRIU will create something in must be root's alone: each directory from
  the root down owned by root and writable by no one else (group root's may be; a sticky
  one, like /tmp or /dev/shm, may be world-writable: nobody else can rename or replace what
  root makes there);
- at post-restore (the tree exists, has not run) every descriptor, mapping, working and root
  directory and executable of every restored process that names a file system object is
  compared with the pinned objects; one that is none of them (CRIU was led elsewhere) undoes
  the restore. A deleted object passes only in a directory of a pinned or created path:
  the ghost and link-remap files CRIU made there and removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from ckptd.adapters.procfs import relinks
from ckptd.adapters.procfs.safefs import Root, UnsafePath, components
from ckptd.core.ports import CriuPaths
from ckptd.core.ports.criu import CriuRelink

_DELETED = " (deleted)"
_KERNEL_NAMES = ("/memfd:", "/SYSV", "/dev/zero", "/anon_hugepage", "/[", "/proc/", "/sys/")
_PROC = "/proc"
"""The tree's /proc, which CRIU still holds in the restored tasks at post-restore."""
"""What /proc names a memfd, SysV or anonymous shared memory, or an object of the tree's own
pseudo file systems: not reached by path through a directory anyone could swap (what CRIU
opens through a swapped directory shows the path it really reached, never these)."""
Identity = tuple[int, int]


def pin_paths(root: Root, paths: CriuPaths, proc: Path = Path("/proc"), *,
              owns_root: bool = False) -> ProcPinnedPaths:
    """Every ``paths.opened`` that exists reached from ``root`` with no link followed and
    held; every directory of ``paths.created`` checked to be root's alone; before that, each
    missing link-remap file of ``paths.relinks`` made again (``relinks.make``), removed when
    the pins close. Raises UnsafePath (nothing held, nothing made then). ``owns_root``:
    ``root`` is closed with the pins."""
    pins = ProcPinnedPaths(root if owns_root else None, proc)
    by_dir: dict[str, list[str]] = {}
    for path in paths.opened:  # each directory walked once (a job maps hundreds of files)
        by_dir.setdefault(path.rsplit("/", 1)[0] if path != "/" else "/", []).append(path)
    try:
        for made in paths.created:  # checked before anything is made there
            if made.what == "link-remap file":
                root_alone(root, made.path, made.what, made.owner)
        pins.relinked(root, relinks.make(root, paths.relinks))
        for group in by_dir.values():
            pins.pin(root, group)
        for made in paths.created:
            root_alone(root, made.path, made.what, made.owner)
            if made.what != "unix socket":
                pins.allow_deleted_in(made.path)
            elif made.owner >= 0:
                pins.socket_dir(root, made.path, made.owner)
    except BaseException:
        pins.close()
        raise
    return pins


def root_alone(root: Root, path: str, what: str, owner: int = -1) -> None:
    """Every existing directory on the way to ``path`` (from the root down) is root's (or
    ``owner``'s, when not -1) and writable by nobody else, or sticky. Raises UnsafePath
    naming the first that is not."""
    parts = components(path)[:-1]
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY, dir_fd=root.fd)
    try:
        where = "/"
        for i in range(len(parts) + 1):
            problem = _not_roots(os.fstat(fd), owner)
            if problem:
                raise UnsafePath(errno.EPERM, (
                    f"CRIU would create or remove the {what} {root.label}{path} by path as "
                    f"root, but "
                    f"{root.label}{where} {problem}: ckptd lets CRIU create files only where "
                    "root alone can change the directories"))
            if i == len(parts):
                break
            where = "/" + "/".join(parts[: i + 1])
            try:
                nfd = os.open(parts[i], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    break  # CRIU makes it (a ghost's missing directory) below a checked one
                if exc.errno == errno.ELOOP:
                    raise UnsafePath(errno.ELOOP, (
                        f"{root.label}{where} is a symbolic link (on the way to {path}, "
                        f"where CRIU would create the {what}): ckptd does not follow links "
                        "as root")) from exc
                raise
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def link_remap_problems(root: Root, paths: Iterable[str]) -> tuple[str, ...]:
    """Why CRIU's dump may not link back each deleted-but-linked file of ``paths`` as
    ``link_remap.N`` beside it, by path, as root: one line per file whose directory is not
    root's alone (``root_alone``); () when every one may be."""
    problems = []
    for path in paths:
        try:
            root_alone(root, path.rsplit("/", 1)[0] + "/link_remap.N", "link-remap file")
        except OSError as exc:
            problems.append(f"{path} (deleted, still linked elsewhere): {exc.strerror or exc}")
    return tuple(problems)


_PROC_SUPER_MAGIC = 0x9FA0
_libc = ctypes.CDLL(None, use_errno=True)


def _on_procfs(link: Path) -> bool:
    """Whether what ``link`` (/proc/PID/fd/N, ...) names lies on a proc file system."""
    try:
        fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first
        if _libc.fstatfs(fd, buf) != 0:
            return False
        return ctypes.c_long.from_buffer(buf).value == _PROC_SUPER_MAGIC
    finally:
        os.close(fd)


def _not_roots(st: os.stat_result, owner: int = -1) -> str:
    """Why a directory is not root's (or ``owner``'s) alone ("" when it is)."""
    if st.st_uid not in (0, owner):
        return f"is owned by uid {st.st_uid}"
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky:
        return "is writable by every user"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0 and not sticky:  # (an owner's group too)
        return f"is writable by group {st.st_gid}"
    return ""


class ProcPinnedPaths:
    """``PinnedPaths`` over /proc: the pinned objects' descriptors and identities."""

    def __init__(self, root: Root | None, proc: Path) -> None:
        self._root = root
        self._proc = proc
        self._fds: list[int] = []
        self._ids: dict[Identity, str] = {}
        self._dirs: set[str] = set()
        """Directories where a deleted object may lie (of the pinned and created paths)."""
        self._made: tuple[CriuRelink, ...] = ()
        self._made_in: Root | None = None
        """The link-remap files ``pin_paths`` made (removed at ``close``), and their root."""
        self._made_dirs: list[tuple[int, str, Identity]] = []
        """Directories ``socket_dir`` made: (parent's fd, name, identity)."""

    def relinked(self, root: Root, made: tuple[CriuRelink, ...]) -> None:
        self._made, self._made_in = made, root

    def socket_dir(self, root: Root, path: str, owner: int) -> None:
        """Make the missing directory a unix socket of ``owner``'s is bound in (CRIU binds it
        by path: multiprocessing's ``/tmp/pymp-*``, which a worker that ended on its own
        removed), ``0700`` and ``owner``'s, as its program made it, when the directory above
        it exists (checked by ``root_alone``: root's alone, sticky, or ``owner``'s); made by
        root in that held directory and only then given to ``owner`` (nobody else can
        rename a root's entry in a sticky or root's directory meanwhile). Removed at
        ``close`` while it is that very directory and empty (the restore failed)."""
        parts = components(path)
        if len(parts) < 2:
            return
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), \
                root.locate("/" + "/".join(parts[:-1])) as loc:
            try:
                os.mkdir(loc.name, 0o700, dir_fd=loc.dirfd)
            except FileExistsError:
                return
            fd = root.open_in(loc, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fchown(fd, owner, -1)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            self._made_dirs.append((os.dup(loc.dirfd), loc.name, (st.st_dev, st.st_ino)))

    @property
    def identities(self) -> dict[Identity, str]:
        return dict(self._ids)

    def pin(self, root: Root, paths: Sequence[str]) -> None:
        """``paths`` (of one directory) reached from ``root`` with no link followed and
        held; a missing one is skipped (CRIU fails on it, as without ckptd)."""
        try:
            if paths == ["/"]:
                self._hold(os.dup(root.fd), "/")
                return
            with root.locate(paths[0]) as loc:
                for path in paths:
                    try:
                        fd = root.open_in(loc, os.O_PATH, name=path.rsplit("/", 1)[1])
                    except FileNotFoundError:
                        continue
                    self._hold(fd, path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except UnsafePath:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return
            raise UnsafePath(exc.errno or errno.EIO,
                             f"{root.label}{paths[0]} cannot be checked: {exc}") from exc

    def _hold(self, fd: int, path: str) -> None:
        self._fds.append(fd)
        st = os.fstat(fd)
        self._ids[(st.st_dev, st.st_ino)] = path

    def allow_deleted_in(self, path: str) -> None:
        self._dirs.add(path.rsplit("/", 1)[0] or "/")

    def stray(self, pid: int, allowed: Sequence[int] = (),
              own_dirs: Sequence[Path] = ()) -> tuple[str, ...]:
        ours = self.ours(allowed, own_dirs)
        base = self._proc / str(pid)
        try:  # the tree's root as the daemon names it (a container's), stripped off below
            prefix = os.readlink(base / "root").rstrip("/")
        except OSError:
            prefix = ""
        found: list[str] = []
        for slot, link in self._slots(base):
            try:
                target = os.readlink(link)
                st = os.stat(link)
            except OSError:
                continue  # gone, or not a file system object
            if (st.st_dev, st.st_ino) in ours:
                continue
            shown = target  # as the daemon sees it
            if prefix and (target == prefix or target.startswith(prefix + "/")):
                target = target[len(prefix):] or "/"
            if not target.startswith("/") or target.startswith(_KERNEL_NAMES) or \
                    target == _PROC:
                continue  # pipe:[..], socket:[..], anon_inode:.., memfd, shared memory
            if (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) and \
                    target.startswith("/dev/"):
                continue  # a terminal or device node: only root makes those in /dev
            if target.endswith(_DELETED):  # (still linked as its ghost until CRIU ends)
                where = target[: -len(_DELETED)].rsplit("/", 1)[0] or "/"
                if where in self._dirs:
                    continue
            if _on_procfs(link):
                continue  # a /proc CRIU mounted for a new pid namespace, still held in it
            found.append(f"{slot} is {shown!r}")
        return tuple(found)

    def ours(self, allowed: Sequence[int], own_dirs: Sequence[Path]) -> set[Identity]:
        """The pinned identities, those of ``allowed`` and of ``own_dirs`` and the files
        directly in them."""
        found = set(self._ids)
        for fd in allowed:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                found.add((st.st_dev, st.st_ino))
        for where in own_dirs:
            with contextlib.suppress(OSError):
                st = os.lstat(where)
                found.add((st.st_dev, st.st_ino))
                with os.scandir(where) as listing:
                    for entry in listing:
                        with contextlib.suppress(OSError):
                            est = entry.stat(follow_symlinks=False)
                            found.add((est.st_dev, est.st_ino))
        return found

    @staticmethod
    def _slots(base: Path) -> Iterable[tuple[str, Path]]:
        for name in ("cwd", "root", "exe"):
            yield name, base / name
        with contextlib.suppress(OSError):
            for fd in sorted(os.listdir(base / "fd"), key=lambda n: (len(n), n)):
                yield f"fd {fd}", base / "fd" / fd
        with contextlib.suppress(OSError):
            for area in sorted(os.listdir(base / "map_files")):
                yield f"mapping {area}", base / "map_files" / area

    def close(self) -> None:
        """Release the pins; remove the link-remap files ``pin_paths`` made that are still
        there (CRIU removes them when it restores; not when it fails or never runs)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for parent, name, made_id in self._made_dirs:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == made_id:
                    os.rmdir(name, dir_fd=parent)  # ENOTEMPTY: the restored socket is in it
            with contextlib.suppress(OSError):
                os.close(parent)
        self._made_dirs = []
        made, self._made = self._made, ()
        if made and self._made_in is not None and self._made_in.fd >= 0:
            relinks.remove(self._made_in, made)
        self._made_in = None
        if self._root is not None:
            self._root.close()
            self._root = None
