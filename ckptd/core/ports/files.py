"""The ports for what a job reads and writes outside CRIU: files it writes (captured
and put back), and its stdio on restore."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckptd.core.ports.criu import CriuPaths, CriuRelink, InheritFd
from ckptd.domain import CapturedFile, ProcessFact, StdioFact


@dataclass(frozen=True)
class WrittenFile:
    """A regular file a process of a tree has open for writing or maps shared-writable."""

    path: str
    """As the daemon sees it (its mount namespace)."""
    size: int
    source: str
    """Where its content is read from: the writing process's own descriptor or mapping, so a
    path replaced meanwhile is never read instead."""
    pid: int
    append_only: bool = False
    """Every descriptor of the tree that writes it appends (O_APPEND) and none maps it: what
    is in it now stays as it is while the tree runs (it can only grow), so it can be copied
    before the tree is frozen and only its new tail while it is."""
    size_free: bool = False
    """Every descriptor of the tree that writes it is ``O_WRONLY|O_APPEND`` and none maps
    it: CRIU records no size for it (its restore takes the file grown)."""


@dataclass(frozen=True)
class SharedFile:
    """A file of a tree's (written, or captured) that processes outside it hold open for
    writing or map shared and writable now."""

    path: str
    writers: tuple[tuple[int, str], ...]
    """(pid, command) of each such process."""
    size: int = -1
    """Its size now (-1: not known)."""

    @property
    def named(self) -> str:
        """"pid N (command), pid M (command)"."""
        return ", ".join(f"pid {pid} ({command})" for pid, command in self.writers)


@dataclass(frozen=True)
class GhostFile:
    """A file a process of a tree holds open or mapped after it was deleted (no link left:
    CRIU copies its content into the images, up to ``ghost_limit``): PyTorch's shared memory
    in /dev/shm is such files."""

    path: str
    """As the holder sees it, without " (deleted)"."""
    size: int
    """Its allocated bytes (what CRIU copies and compares with its limit)."""
    pid: int
    """One process holding it."""


@dataclass(frozen=True)
class DirFiles:
    """The regular files under a job's output directories (``JobFiles.in_dirs``), each held
    open for its capture (``source``) and ``size_free`` (the tree does not hold it: CRIU
    checks nothing of it at a restore)."""

    files: tuple[WrittenFile, ...] = ()
    problems: tuple[str, ...] = ()
    """What could not be read, one line each ("/out (no such directory)")."""
    over: bool = False
    """The directories hold more files than the limit asked for (``files`` stops there)."""


class NotCaptured(Exception):
    """``JobFiles.capture`` of a file whose content cannot be read without harm to the job
    (the message says why: a lease its reading would break): the dump records it among the
    files not captured, as a file over the capture limit."""


@dataclass(frozen=True)
class Precopy:
    """The first ``size`` bytes of an append-only file, copied while the tree ran; ``state``
    is the adapter's (the file's identity, the running hash)."""

    path: str
    size: int
    state: object = None


class PinnedPaths(Protocol):
    """``CriuPaths.opened``, each held (an ``O_PATH`` descriptor) as it was reached with no
    link followed before CRIU ran, so that its identity cannot be reused meanwhile.

    Invariant: ``stray`` compares what a restored process holds by path with these very
    objects (``st_dev``, ``st_ino``): a directory swapped while CRIU resolved a path (its
    object then another one, reached through a link or a moved directory) is found before
    the tree runs."""

    def stray(self, pid: int, allowed: Sequence[int] = (),
              own_dirs: Sequence[Path] = ()) -> tuple[str, ...]:
        """What process ``pid`` (restored, not yet run) holds by path — descriptors, working
        and root directory, executable, file mappings — that is none of the pinned objects,
        one line each ("fd 3 is /root/secret"); ``allowed``: descriptors of ours whose
        objects the tree may hold (its stdio replacements); ``own_dirs``: ckptd's own
        directories, root's, whose files CRIU still holds in the tree then (its log, its
        images: closed before the tree runs), they and what is directly in them pass.
        Deleted objects (the ghost and
        link-remap files CRIU made and removed) pass only within a directory of a pinned
        or created path."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class FileCheck:
    """A captured file against what is at its path now."""

    differs: bool
    """Missing, or another size or content: a restore puts it back (keeping this one)."""
    problem: str = ""
    """Why it could not be put back ("" when it can)."""


@dataclass(frozen=True)
class PutBack:
    """One file a restore put back (or is about to): ``aside`` holds the version found there
    ("" when there was none: the file was ``created``). ``dev``/``ino`` identify the file put
    back (0 while it is not created yet), so that an undo acts only on that very file;
    ``temp`` is the temporary a crash may have left beside it (removed by the undo);
    ``mode`` the permission bits found (put back by the undo; 0 for a created file);
    ``moved_from``: the file (``dev``/``ino``) was only renamed from that path to ``path``
    (following a log rotation): the undo renames it back. ``aside_ino``/``aside_uid``: the
    copy kept aside once made (same ``st_dev`` as the file: the same directory), for the
    record of what this restore made (``ports.asides``); 0/-1 until then."""

    path: str
    aside: str
    created: bool = False
    dev: int = 0
    ino: int = 0
    temp: str = ""
    mode: int = 0
    moved_from: str = ""
    aside_ino: int = 0
    aside_uid: int = -1


class JobFiles(Protocol):
    """The files a tree writes: listed and captured at a checkpoint (the tree frozen), put
    back at a restore. Content operations act with the given owner's file-system rights."""

    def written(self, tree: Sequence[ProcessFact]) -> tuple[WrittenFile, ...]:
        """Every regular file ``tree`` has open for writing or mapped shared and writable,
        one per path (deleted files, /proc, /sys and devices left out; /dev/shm kept)."""
        ...

    def shared(
        self, files: Sequence[WrittenFile | CapturedFile], outside: Collection[int] = ()
    ) -> tuple[SharedFile, ...]:
        """Of ``files``, those that processes other than the ones in ``outside`` (the tree,
        at a dump) and this one hold open for writing or map shared and writable, matched
        by identity (``st_dev``, ``st_ino``: a written file's through its writer's
        descriptor, a captured one's at its path now, no link followed): one pass over every
        process's descriptors and mappings for all of them. Processes that wrote and closed
        the file since are not seen (nothing holds it then)."""
        ...

    def ghosts(self, tree: Sequence[ProcessFact]) -> tuple[GhostFile, ...]:
        """Every deleted file ``tree`` holds open or mapped (no link left: a ghost), once
        each however many descriptors and mappings hold it; read from /proc, the tree
        running (memfds and shared anonymous memory are not files: left out)."""
        ...

    def relink_problems(self, tree: Sequence[ProcessFact]) -> tuple[str, ...]:
        """Why CRIU's dump may not link back the deleted files ``tree`` holds that still
        have a link elsewhere (it makes ``link_remap.N`` beside each, by path, as root; the
        restore opens and removes it there): one line per such file whose directory anyone
        but root can change (``pin``'s rule for what CRIU creates); () when none."""
        ...

    def link_remaps(self, found: Sequence[CriuRelink]) -> tuple[CriuRelink, ...]:
        """``found`` (CRIU's dump images' link-remap files, CRIU at post-dump: each still on
        disk) with ``linked_as`` set to the other name of each one's object in its own
        directory; "" where there is none."""
        ...

    def remove_link_remaps(self, found: Sequence[CriuRelink]) -> None:
        """Unlink each link-remap file while it is the very object its ``linked_as`` names
        (one missing, or another object, is left)."""
        ...

    def in_dirs(
        self, dirs: Sequence[str], pid: int, uid: int, gid: int,
        leave_out: Sequence[WrittenFile], limit: int,
    ) -> AbstractContextManager[DirFiles]:
        """The regular files under each of ``dirs`` (absolute, as process ``pid`` sees them:
        its root), walked with no link followed and with the file-system rights of
        ``uid``/``gid``, each held open until the context exits (``capture`` reads it from
        there); the files of ``leave_out`` (the tree's own, by identity) left out; at most
        ``limit`` of them (``over`` says there are more)."""
        ...

    def precopy(self, file: WrittenFile, dest: Path) -> Precopy | None:
        """Copy what an append-only file holds now to ``dest`` (the tree running); None when
        gone."""
        ...

    def capture(
        self, file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        """Copy its content to ``dest`` (zero-padded to whole pages); None when gone;
        ``NotCaptured`` when reading it would harm the job. With
        the ``precopy`` made into ``dest``, only what was appended since is copied (all of it
        when the file is another one now, or shorter)."""
        ...

    def check(self, captured: CapturedFile, uid: int, gid: int) -> FileCheck: ...

    def put_back(
        self, captured: CapturedFile, content: Path, aside: str, uid: int, gid: int,
        before: Callable[[PutBack], None],
    ) -> PutBack | None:
        """Make ``captured.path`` hold the first ``captured.size`` bytes of ``content``; a
        version there that differs is first copied to ``aside`` (complete before it gets
        that name). None: it already held them. On failure the file is as it was.
        ``before`` is called with what undoes each effect before that effect can exist (the
        recipe journals it). Refuses (an ``OSError``) a path with a link on the way, a hard-
        linked file, a file or directory whose owner (or identity) changed since the dump."""
        ...

    def remove_aside(
        self, path: str, dev: int, ino: int, aside_uid: int, uid: int, gid: int
    ) -> str:
        """Remove the copy a restore kept aside at ``path``, recorded as (``dev``, ``ino``,
        owner ``aside_uid``), as the job's owner (``uid``/``gid``), only while that very file
        is there: "" when removed, else why not (gone already, or another file has its name:
        never touched). No link followed; a link on the way raises ``OSError``."""
        ...

    def undo(self, done: PutBack, uid: int, gid: int) -> None:
        """The file exactly as ``put_back`` found it (the copy aside removed), from any point
        a put-back reached (also after a crash, from the journaled ``PutBack``)."""
        ...

    def pin(self, paths: CriuPaths) -> PinnedPaths:
        """Every ``paths.opened`` that exists, reached from this port's root with no link
        followed and held (a missing one is left to CRIU, which fails on it), after each
        missing link-remap file of ``paths.relinks`` is linked again from its ``linked_as``
        (removed when the pins close, if CRIU has not; refused when it cannot be); every
        directory ``paths.created`` lies in checked to be root's alone (each directory from the root
        down owned by root and writable by nobody else, or sticky). Raises ``UnsafePath``
        (an ``OSError``) naming the link, or the directory and the uid that can change it."""
        ...

    def seen_by(self, pid: int) -> JobFiles:
        """The same port with ``check``/``put_back``/``undo`` acting on paths as process
        ``pid`` sees them (its root file system: a container's), never escaping that root
        through a symbolic link. Raises ProcessNotFound when ``pid`` is gone."""
        ...


class StdioProvider(Protocol):
    """Replacements, at restore, for stdio descriptors whose other end is outside the tree."""

    def replacements(
        self, stdio: Sequence[StdioFact], output_path: Path, owner: tuple[int, int] = (0, 0),
        chosen_by_caller: bool = False,
    ) -> AbstractContextManager[tuple[InheritFd, ...]]:
        """Descriptors to hand to CRIU; ours are closed when the context exits (the restored
        tree keeps its own copies). The output file belongs to ``owner`` (uid, gid): a path
        the caller chose is opened with the owner's file-system identity (never root's for a
        user's job), one the daemon chose is created by root and given to the owner."""
        ...

    def from_process(
        self, stdio: Sequence[StdioFact], pid: int
    ) -> AbstractContextManager[tuple[InheritFd, ...]]:
        """Replacements taken from process ``pid`` (the init of the container restored
        into): each external descriptor 0-2 becomes the same descriptor of ``pid``, reopened
        (a pipe to its runtime: the tree writes to the container's log); any other external
        one its stdout when written, /dev/null when read. Ours are closed on exit. Raises
        ProcessNotFound when ``pid`` or its descriptor is gone."""
        ...
