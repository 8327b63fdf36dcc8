"""The ``JobFiles`` port on Linux: which files a tree writes (/proc), their content captured
at a checkpoint (``filecopy``) and put back at a restore (``putback``).

Invariants:
- content is always read through the writing process's own descriptor or mapping
  (``/proc/PID/fd/N``, ``/proc/PID/map_files/A-B``), never by path;
- a file is put back fd-relative from a pinned root (``safefs``: the node's ``/``, or a
  container's root opened once), no link followed anywhere on the way, and with the
  checkpoint owner's file-system identity (``setfsuid``, this thread only): a user's restore
  never writes where that user could not, and root never writes where the path was
  redirected;
- nothing on disk is lost: a version that differs from the checkpoint's is first copied beside
  the file, and ``undo`` puts it back byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from ckptd.adapters.procfs import outdirs, relinks
from ckptd.adapters.procfs.asides import remove_recorded
from ckptd.adapters.procfs.filecopy import capture_file, precopy_file
from ckptd.adapters.procfs.ghosts import ghost_files, relinked_files
from ckptd.adapters.procfs.node import fd_flags
from ckptd.adapters.procfs.pathpins import ProcPinnedPaths, link_remap_problems, pin_paths
from ckptd.adapters.procfs.putback import check_file, put_back, rotated_set, undo_put_back
from ckptd.adapters.procfs.rootpath import process_root, same_root
from ckptd.adapters.procfs.safefs import Root, UnsafePath, boot_id
from ckptd.adapters.procfs.sharers import writers_of
from ckptd.adapters.procfs.stdio import _as_user
from ckptd.core.ports import CriuPaths, DirFiles, FileCheck, Precopy, PutBack, WrittenFile
from ckptd.core.ports.criu import CriuRelink
from ckptd.core.ports.files import GhostFile, SharedFile
from ckptd.domain import CapturedFile, ProcessFact
from ckptd.errors import ProcessNotFound

_SKIPPED_ROOTS = ("/proc/", "/sys/", "/dev/")
_KEPT_UNDER_DEV = ("/dev/shm/",)
_NOT_THE_JOBS = ("/dev/shm/sem.",)
"""Named POSIX semaphores (``sem_open``; multiprocessing's spawn and forkserver contexts):
synchronisation state, restored as CRIU restores it (the object itself, linked back), not
content ckptd rolls back."""
_CRIUS = "/link_remap."
"""CRIU's own link-remap files (a dump's hard link of a deleted file, ``relinks``)."""


class ProcJobFiles:
    """``JobFiles`` over /proc and the local file systems. ``check``/``put_back``/``undo``
    resolve paths from a root opened once (``root``: a container's, from ``seen_by``; None:
    the node's ``/``, opened at each call)."""

    def __init__(
        self, proc: Path = Path("/proc"), *, owner_rights: bool = True, root: Root | None = None
    ) -> None:
        self._proc = proc
        self._owner_rights = owner_rights
        self._root = root

    def seen_by(self, pid: int) -> ProcJobFiles:
        if not (self._proc / str(pid)).exists():
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        if same_root(self._proc, pid):
            return self
        try:  # pinned now: a container that swaps its root later changes nothing
            root = Root.of_directory(process_root(self._proc, pid), "the container's ")
        except FileNotFoundError as exc:
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid) from exc
        return ProcJobFiles(self._proc, owner_rights=self._owner_rights, root=root)

    def pin(self, paths: CriuPaths) -> ProcPinnedPaths:
        if self._root is not None:
            return pin_paths(self._root, paths, self._proc)
        return pin_paths(Root.node(), paths, self._proc, owns_root=True)

    @contextlib.contextmanager
    def _at(self) -> Iterator[Root]:
        if self._root is not None:
            yield self._root
            return
        root = Root.node()
        try:
            yield root
        finally:
            root.close()

    def written(self, tree: Sequence[ProcessFact]) -> tuple[WrittenFile, ...]:
        found: dict[str, WrittenFile] = {}
        overwritten: set[str] = set()  # written without O_APPEND, or mapped
        sized: set[str] = set()  # CRIU records its size: not O_WRONLY|O_APPEND everywhere
        for proc in tree:
            for written, flags in self._open_for_writing(proc.pid):
                found.setdefault(written.path, written)
                if not flags & os.O_APPEND:
                    overwritten.add(written.path)
                if flags & os.O_ACCMODE != os.O_WRONLY or not flags & os.O_APPEND:
                    sized.add(written.path)
            for written in self._mapped_shared_writable(proc.pid):
                found.setdefault(written.path, written)
                overwritten.add(written.path)
                sized.add(written.path)
        return tuple(replace(found[p], append_only=p not in overwritten,
                             size_free=p not in sized) for p in sorted(found))

    def shared(
        self, files: Sequence[WrittenFile | CapturedFile], outside: Collection[int] = ()
    ) -> tuple[SharedFile, ...]:
        wanted: dict[tuple[int, int], str] = {}
        sizes: dict[str, int] = {}
        with self._at() as root:
            for file in files:
                st = self._identity(root, file)
                if st is not None:
                    wanted.setdefault((st.st_dev, st.st_ino), file.path)
                    sizes[file.path] = st.st_size
        found = writers_of(self._proc, wanted, outside)
        return tuple(SharedFile(path, tuple(found[path]), sizes.get(path, -1))
                     for path in sorted(found))

    @staticmethod
    def _identity(root: Root, file: WrittenFile | CapturedFile) -> os.stat_result | None:
        """A written file's through its writer's descriptor; a captured one's at its path
        (in this port's root), no link followed."""
        try:
            if isinstance(file, WrittenFile):
                return os.stat(file.source)
            with root.locate(file.path) as loc:
                probe = root.open_in(loc, os.O_PATH)
                try:
                    return os.fstat(probe)
                finally:
                    os.close(probe)
        except OSError:
            return None

    def ghosts(self, tree: Sequence[ProcessFact]) -> tuple[GhostFile, ...]:
        return ghost_files(self._proc, tree)

    def relink_problems(self, tree: Sequence[ProcessFact]) -> tuple[str, ...]:
        with self._at() as root:
            return link_remap_problems(root, relinked_files(self._proc, tree))

    def link_remaps(self, found: Sequence[CriuRelink]) -> tuple[CriuRelink, ...]:
        with self._at() as root:
            return relinks.linked_as(root, found)

    def remove_link_remaps(self, found: Sequence[CriuRelink]) -> None:
        with self._at() as root:
            relinks.remove(root, found)

    @contextlib.contextmanager
    def in_dirs(
        self, dirs: Sequence[str], pid: int, uid: int, gid: int,
        leave_out: Sequence[WrittenFile], limit: int,
    ) -> Iterator[DirFiles]:
        if not dirs:
            yield DirFiles()
            return
        # walked as the owner, with this thread's identity back before the capture runs
        with self._at() as root, self._rights(uid, gid):
            found, held = outdirs.open_under(root, dirs, pid, leave_out, limit)
        try:
            yield found
        finally:
            outdirs.close_all(held)

    def precopy(self, file: WrittenFile, dest: Path) -> Precopy | None:
        return precopy_file(file, dest)

    def capture(
        self, file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        dirs, rotated = self._dirs_of(file)
        return capture_file(file, dest, precopy, dirs=dirs, boot=boot_id(), rotated=rotated)

    def check(self, captured: CapturedFile, uid: int, gid: int) -> FileCheck:
        try:
            with self._at() as root, self._rights(uid, gid):
                return check_file(root, captured)
        except UnsafePath as exc:
            return FileCheck(differs=True, problem=str(exc.strerror or exc))

    def put_back(
        self, captured: CapturedFile, content: Path, aside: str, uid: int, gid: int,
        before: Callable[[PutBack], None],
    ) -> PutBack | None:
        with self._at() as root, self._rights(uid, gid):
            return put_back(root, captured, content, aside, before)

    def remove_aside(
        self, path: str, dev: int, ino: int, aside_uid: int, uid: int, gid: int
    ) -> str:
        with self._at() as root, self._rights(uid, gid):
            return remove_recorded(root, path, dev, ino, aside_uid)

    def undo(self, done: PutBack, uid: int, gid: int) -> None:
        with self._at() as root, self._rights(uid, gid):
            undo_put_back(root, done)

    def _dirs_of(
        self, file: WrittenFile
    ) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[str, int, int], ...]]:
        """The directories on ``file``'s path as its writer sees them (its root), and its
        rotated set beside it (``putback.rotated_set``)."""
        try:
            if same_root(self._proc, file.pid):
                root = Root.node()
            else:
                root = Root.of_directory(process_root(self._proc, file.pid), "")
            try:
                with root.locate(file.path) as loc:
                    return loc.chain, tuple(
                        (name, st.st_dev, st.st_ino)
                        for name, st in sorted(rotated_set(root, loc).items()))
            finally:
                root.close()
        except OSError:
            return (), ()  # links are refused at restore all the same

    # ---- internals ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rights(self, uid: int, gid: int) -> Iterator[None]:
        if self._owner_rights and uid != 0:
            with _as_user(uid, gid):
                yield
        else:
            yield

    def _open_for_writing(self, pid: int) -> Iterator[tuple[WrittenFile, int]]:
        """Each regular file open for writing, and that descriptor's flags."""
        fd_dir = self._proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            return
        for name in fds:
            try:
                target = os.readlink(fd_dir / name)
                flags = fd_flags(self._proc / str(pid) / "fdinfo" / name)
                if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
                    continue
                if not _capturable(target):
                    continue
                st = os.stat(fd_dir / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield WrittenFile(target, st.st_size, str(fd_dir / name), pid), flags

    def _mapped_shared_writable(self, pid: int) -> Iterator[WrittenFile]:
        base = self._proc / str(pid)
        try:
            lines = (base / "maps").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[1][1] != "w" or parts[1][3] != "s":
                continue
            path = parts[5]
            if not _capturable(path):
                continue
            source = base / "map_files" / parts[0]
            try:
                st = os.stat(source)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield WrittenFile(path, st.st_size, str(source), pid)


def _capturable(path: str) -> bool:
    """A path of a file system file (not deleted: CRIU keeps those itself; not /proc, /sys
    or devices, but POSIX shared memory under /dev/shm; not a named semaphore, nor a
    link-remap file of CRIU's)."""
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return False
    if path.startswith(_NOT_THE_JOBS) or _CRIUS in path:
        return False
    return path.startswith(_KEPT_UNDER_DEV) or not path.startswith(_SKIPPED_ROOTS)
