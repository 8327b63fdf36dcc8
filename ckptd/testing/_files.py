"""``FakeJobFiles``: the ``JobFiles`` port over files a test declares written by fake pids."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.adapters.procfs import outdirs, relinks
from ckptd.adapters.procfs.asides import remove_recorded
from ckptd.adapters.procfs.filecopy import capture_file, precopy_file
from ckptd.adapters.procfs.pathpins import ProcPinnedPaths, link_remap_problems, pin_paths
from ckptd.adapters.procfs.putback import check_file, put_back, undo_put_back
from ckptd.adapters.procfs.safefs import Root, UnsafePath, boot_id
from ckptd.core.ports import CriuPaths, DirFiles, FileCheck, Precopy, PutBack, WrittenFile
from ckptd.core.ports.criu import CriuRelink
from ckptd.core.ports.files import GhostFile, SharedFile
from ckptd.domain import CapturedFile, ProcessFact

if TYPE_CHECKING:
    from ckptd.core.ports import JobFiles


class FakeJobFiles:
    """A ``JobFiles`` whose ``written`` reports the real files (e.g. under a test's tmp_path)
    that ``open_for_writing`` declared for fake pids; capture and put-back act on those real
    files as the real adapter does, without switching file-system identity (tests need not
    run as root). Records ``events`` (``"files.capture <path>"``, ``"files.put_back
    <path>"``, ``"files.undo <path>"``) when given a list; ``fail_put_back`` makes putting
    that path back raise ``OSError`` (after those before it were put back)."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.writes: dict[int, list[str]] = {}
        self.appending: set[str] = set()
        self.events = events
        self.fail_put_back: set[str] = set()
        self.roots: dict[int, Path] = {}
        """``seen_by(pid)``: a directory standing for that process's root file system (a
        container's); check/put_back/undo then act on ``root + path``, the paths reported
        unchanged. A pid not there sees the node's."""
        self.root: Path | None = None
        self.ghost_files: dict[int, list[tuple[str, int]]] = {}
        """``hold_ghost``: the deleted files each fake pid holds (path, size)."""
        self.relinked: dict[int, list[str]] = {}
        """``hold_relinked``: deleted files each fake pid holds that are linked elsewhere."""
        self.opens: dict[int, list[tuple[str, str]]] = {}
        """``pin``: what fake CRIU opened by path for each restored pid, as (slot, path): each
        is resolved following links, as CRIU does, when ``stray`` is asked."""
        self.outside: dict[str, list[tuple[int, str]]] = {}
        """``written_outside``: processes (pid, command) declared to write each path (they
        need not be outside a tree: ``shared``'s ``outside`` leaves out a tree's)."""
        self.pinned: list[CriuPaths] = []
        self.open_pins = 0
        """Pins not closed yet (a recipe must close every one)."""

    def seen_by(self, pid: int) -> FakeJobFiles:
        root = self.roots.get(pid)
        if root is None:
            return self
        view = FakeJobFiles(self.events)
        view.writes, view.appending, view.fail_put_back = (
            self.writes, self.appending, self.fail_put_back)
        view.ghost_files = self.ghost_files
        view.root = root
        view.opens, view.pinned, view.relinked = self.opens, self.pinned, self.relinked
        view.outside = self.outside
        return view

    def pin(self, paths: CriuPaths) -> _FakePinnedPaths:
        """The real pinning (``pathpins.pin_paths``) of these real paths; ``stray`` compares
        what ``opens`` says fake CRIU opened for a pid with them."""
        self.pinned.append(paths)
        root = Root.node() if self.root is None else Root.of_directory(self.root, "")
        pins = _FakePinnedPaths(self, pin_paths(root, paths, owns_root=True))
        self.open_pins += 1
        return pins

    @contextlib.contextmanager
    def _at(self) -> Iterator[Root]:
        root = Root.node() if self.root is None else Root.of_directory(self.root, "")
        try:
            yield root
        finally:
            root.close()

    def open_for_writing(self, pid: int, path: str | Path, *, append: bool = False) -> None:
        """Fake ``pid`` writes ``path`` (``append``: only through O_APPEND)."""
        self.writes.setdefault(pid, []).append(str(path))
        if append:
            self.appending.add(str(path))

    def written(self, tree: Sequence[ProcessFact]) -> tuple[WrittenFile, ...]:
        found: dict[str, WrittenFile] = {}
        for proc in tree:
            for path in self.writes.get(proc.pid, ()):
                if os.path.isfile(path):
                    found.setdefault(path, WrittenFile(path, os.path.getsize(path), path,
                                                       proc.pid, path in self.appending,
                                                       path in self.appending))
        return tuple(found[p] for p in sorted(found))

    def written_outside(self, path: str | Path, pid: int, command: str = "writer") -> None:
        """Fake ``pid`` (``command``) holds ``path`` open for writing."""
        self.outside.setdefault(str(path), []).append((pid, command))

    def shared(
        self, files: Sequence[WrittenFile | CapturedFile], outside: Collection[int] = ()
    ) -> tuple[SharedFile, ...]:
        """The files ``written_outside`` declared written by pids not in ``outside`` (and
        still there, in this view's root)."""
        found: list[SharedFile] = []
        for path in sorted({f.path for f in files}):
            writers = tuple(w for w in self.outside.get(path, ()) if w[0] not in outside)
            where = (str(self.root) + path) if self.root else path
            if writers and os.path.isfile(where):
                found.append(SharedFile(path, writers, os.path.getsize(where)))
        return tuple(found)

    def hold_ghost(self, pid: int, path: str, size: int) -> None:
        """Fake ``pid`` holds the deleted file ``path`` of ``size`` allocated bytes (several
        pids may hold one path: it counts once)."""
        self.ghost_files.setdefault(pid, []).append((path, size))

    def ghosts(self, tree: Sequence[ProcessFact]) -> tuple[GhostFile, ...]:
        found: dict[str, GhostFile] = {}
        for proc in tree:
            for path, size in self.ghost_files.get(proc.pid, ()):
                found.setdefault(path, GhostFile(path, size, proc.pid))
        return tuple(found[p] for p in sorted(found))

    def hold_relinked(self, pid: int, path: str) -> None:
        """Fake ``pid`` holds ``path`` (a real file's path), deleted but linked elsewhere."""
        self.relinked.setdefault(pid, []).append(path)

    def relink_problems(self, tree: Sequence[ProcessFact]) -> tuple[str, ...]:
        """``link_remap_problems`` (the real rule, on these real paths)."""
        paths = sorted({p for proc in tree for p in self.relinked.get(proc.pid, ())})
        with self._at() as root:
            return link_remap_problems(root, paths)

    def link_remaps(self, found: Sequence[CriuRelink]) -> tuple[CriuRelink, ...]:
        """``relinks.linked_as`` (the real rule, on these real paths)."""
        with self._at() as root:
            return relinks.linked_as(root, found)

    def remove_link_remaps(self, found: Sequence[CriuRelink]) -> None:
        """``relinks.remove`` (the real rule, on these real paths)."""
        self._event("files.remove_link_remaps " + " ".join(r.remap for r in found))
        with self._at() as root:
            relinks.remove(root, found)

    @contextlib.contextmanager
    def in_dirs(
        self, dirs: Sequence[str], pid: int, uid: int, gid: int,
        leave_out: Sequence[WrittenFile], limit: int,
    ) -> Iterator[DirFiles]:
        """The real walk (``outdirs.open_under``) of these real directories (in this view's
        root), without switching file-system identity; the tree's files left out by
        identity, as the real adapter does."""
        with self._at() as root:
            found, held = outdirs.open_under(root, dirs, pid, leave_out, limit)
        try:
            yield found
        finally:
            outdirs.close_all(held)

    def precopy(self, file: WrittenFile, dest: Path) -> Precopy | None:
        self._event(f"files.precopy {file.path}")
        return precopy_file(file, dest)

    def capture(
        self, file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        self._event(f"files.capture {file.path}" + (" (tail)" if precopy else ""))
        try:
            with self._at() as root, root.locate(file.path) as loc:
                dirs = loc.chain
        except OSError:
            dirs = ()
        return capture_file(file, dest, precopy, dirs=dirs, boot=boot_id())

    def check(self, captured: CapturedFile, uid: int, gid: int) -> FileCheck:
        try:
            with self._at() as root:
                return check_file(root, captured)
        except UnsafePath as exc:
            return FileCheck(differs=True, problem=str(exc.strerror or exc))

    def put_back(
        self, captured: CapturedFile, content: Path, aside: str, uid: int, gid: int,
        before: Callable[[PutBack], None],
    ) -> PutBack | None:
        if captured.path in self.fail_put_back:
            raise OSError(f"cannot put back {captured.path} (FakeJobFiles)")
        self._event(f"files.put_back {captured.path}")
        with self._at() as root:
            return put_back(root, captured, content, aside, before)

    def remove_aside(
        self, path: str, dev: int, ino: int, aside_uid: int, uid: int, gid: int
    ) -> str:
        self._event(f"files.remove_aside {path}")
        with self._at() as root:
            return remove_recorded(root, path, dev, ino, aside_uid)

    def undo(self, done: PutBack, uid: int, gid: int) -> None:
        self._event(f"files.undo {done.path}")
        with self._at() as root:
            undo_put_back(root, done)

    def _event(self, text: str) -> None:
        if self.events is not None:
            self.events.append(text)


if TYPE_CHECKING:

    def _is_job_files(files: FakeJobFiles) -> JobFiles:
        return files


class _FakePinnedPaths:
    def __init__(self, files: FakeJobFiles, real: ProcPinnedPaths) -> None:
        self._files = files
        self._real = real
        self._closed = False

    def stray(self, pid: int, allowed: Sequence[int] = (),
              own_dirs: Sequence[Path] = ()) -> tuple[str, ...]:
        ours = self._real.ours(allowed, own_dirs)
        found = []
        for slot, path in self._files.opens.get(pid, ()):
            where = (str(self._files.root) + path) if self._files.root else path
            try:
                st = os.stat(where)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in ours:
                found.append(f"{slot} is {os.path.realpath(where)!r}")
        return tuple(found)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._files.open_pins -= 1
            self._real.close()
