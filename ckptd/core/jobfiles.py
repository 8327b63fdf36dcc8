"""Files the job writes: captured with each checkpoint, put back before each restore.

A leave-running (periodic) checkpoint is only worth something if the job can be restored from
it after it wrote on and died: its log grew, its state file was rewritten, a launcher wrote to
its stdout file. CRIU reopens such files by path and insists on their size at dump. So the dump
captures the content of every file the tree writes (``JobFiles.written``), while the tree is
frozen, as images the store splits into pages like memory (a log that grew by 10 KB costs about
10 KB more); the restore puts each back first, keeping a version that differs beside it
(``<path>.ckptd-<restore id>``), and undoes that if the restore then fails.

Invariants: capture happens only while CRIU holds the tree frozen (content and CRIU's recorded
sizes agree); nothing on disk is destroyed by a restore (a differing version is kept aside, and
a failed restore puts every file back as it found it).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptd.core.config import CoreConfig
from ckptd.core.ports import JobFiles, NotCaptured, Precopy, PutBack, SharedFile, WrittenFile
from ckptd.core.ports.asides import AsideLog, AsideRecord
from ckptd.core.undo import Member, UndoLog, UndoPutBack
from ckptd.domain import CapturedFile, CheckpointRecord, ProcessFact
from ckptd.errors import PreconditionFailed, TargetRefused

log = logging.getLogger(__name__)

IMAGE_PREFIX = "ckptd-file-"
SKIP = "skip"
REFUSE = "refuse"
KEEP = "keep"
ROLL_BACK = "roll-back"


def image_name(path: str) -> str:
    """The image of a captured file: stable per path (so each checkpoint's page list is a
    small delta of the previous one's)."""
    return f"{IMAGE_PREFIX}{hashlib.sha256(path.encode()).hexdigest()[:24]}.img"


def chunked_images(is_pages_image: Callable[[str], bool]) -> Callable[[str], bool]:
    """The store's rule for images split into pages: CRIU's pages, and captured files."""

    def chunked(name: str) -> bool:
        return is_pages_image(name) or (name.startswith(IMAGE_PREFIX) and name.endswith(".img"))

    return chunked


def _fmt(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} B"


def oversized(files: Sequence[WrittenFile], config: CoreConfig) -> list[WrittenFile]:
    return [f for f in files if f.size > config.file_capture_limit]


def refuse_oversized(files: Sequence[WrittenFile], config: CoreConfig, pid: int) -> None:
    """With ``file_capture_oversize = refuse``: one line naming the first file over the limit."""
    big = oversized(files, config)
    if big and config.file_capture_oversize != SKIP:
        first = big[0]
        more = f" (and {len(big) - 1} more)" if len(big) > 1 else ""
        raise TargetRefused(
            f"pid {first.pid} writes {first.path} ({_fmt(first.size)}), over the "
            f"{_fmt(config.file_capture_limit)} a checkpoint captures{more}",
            hint="raise file_capture_limit in the daemon's configuration, or set "
            "file_capture_oversize = skip (a restore then needs that file at its size at dump)",
            pid=pid,
        )


@dataclass
class Capture:
    files: list[CapturedFile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def precopy(
    files: JobFiles, written: Sequence[WrittenFile], images_dir: Path, config: CoreConfig
) -> dict[str, Precopy]:
    """Copy, before the tree is frozen, what its append-only files (of ``written``, listed at
    inspect) hold (they can only grow): the freeze then copies only what they gained
    meanwhile. By path."""
    done: dict[str, Precopy] = {}
    for file in written:
        if file.append_only and file.size <= config.file_capture_limit:
            early = files.precopy(file, images_dir / image_name(file.path))
            if early is not None:
                done[file.path] = early
    return done


def capture(
    files: JobFiles, tree: Sequence[ProcessFact], images_dir: Path, config: CoreConfig,
    pid: int, precopies: dict[str, Precopy] | None = None,
    shared: Mapping[str, SharedFile] | None = None,
    dirs: Sequence[str] = (), dir_files: JobFiles | None = None,
) -> Capture:
    """Capture every file ``tree`` writes into ``images_dir`` (the tree frozen); those with a
    ``precopies`` entry only from where it ended; each recorded with the processes outside
    the tree that ``shared`` (found at inspect: ``outside_writers``) says write it. Also
    every regular file under the output directories ``dirs`` (``DumpRequest.files_dirs``),
    walked by ``dir_files`` (the port as the job sees paths: a container's root) with its
    owner's rights: more files there than ``config.files_dir_max_files`` refuses the dump."""
    written = files.written(tree)
    others = shared or {}
    refuse_oversized(written, config, pid)
    owner = tree[0]
    with (dir_files or files).in_dirs(dirs, pid, owner.uid, owner.gid, written,
                                      config.files_dir_max_files) as found:
        if found.over:
            raise TargetRefused(
                f"the --files directories of pid {pid} ({', '.join(dirs)}) hold more than "
                f"{config.files_dir_max_files} files",
                hint="give the job's output directory itself (not one above it), or raise "
                "files_dir_max_files in the daemon's configuration", pid=pid)
        refuse_oversized(found.files, config, pid)
        result = _capture_all(files, (*written, *found.files), images_dir, config,
                              precopies or {}, others)
        result.skipped.extend(found.problems)
    return result


def _capture_all(
    files: JobFiles, written: Sequence[WrittenFile], images_dir: Path, config: CoreConfig,
    early: Mapping[str, Precopy], others: Mapping[str, SharedFile],
) -> Capture:
    result = Capture()
    for file in written:
        if file.size > config.file_capture_limit:
            result.skipped.append(
                f"{file.path} ({_fmt(file.size)} > {_fmt(config.file_capture_limit)})"
            )
            continue
        try:
            captured = files.capture(file, images_dir / image_name(file.path),
                                     early.get(file.path))
        except NotCaptured as exc:
            result.skipped.append(f"{file.path} ({exc})")
            continue
        if captured is not None:
            sharing = others.get(file.path)
            result.files.append(replace(
                captured, size_free=file.size_free,
                writers=tuple(f"pid {p} ({c})" for p, c in sharing.writers) if sharing else ()))
    kept = {f.path for f in result.files}
    for path in set(early) - kept:  # no longer written by the tree: no image of it
        (images_dir / image_name(path)).unlink(missing_ok=True)
    return result


def outside_writers(
    files: JobFiles, written: Sequence[WrittenFile], tree: Sequence[ProcessFact]
) -> dict[str, SharedFile]:
    """Of the files ``tree`` writes (``written``), those processes outside it write too, by
    path (one scan: ``JobFiles.shared``)."""
    if not written:
        return {}
    return {s.path: s for s in files.shared(written, {p.pid for p in tree})}


def shared_line(shared: SharedFile) -> str:
    return (f"file {shared.path} is written by {shared.named}, outside the checkpoint")


def shared_refusal(shared: SharedFile, captured: CapturedFile, policy: str) -> str:
    """Why a restore refuses ``captured`` under its live writer(s) (``policy``), "" when it
    need not: ``refuse``, or ``keep`` where CRIU needs the file at its checkpoint size
    (the tree did not only append to it) and it has another."""
    if policy == REFUSE:
        return (f"{shared_line(shared)}: rolling it back to the checkpoint would destroy "
                "what that process wrote since (shared_files = \"refuse\")")
    if (policy == KEEP and not captured.size_free and shared.size >= 0
            and shared.size != captured.size):
        return (f"{shared_line(shared)}: it is left as it is (shared_files = \"keep\") but "
                f"has {shared.size} bytes where CRIU needs exactly {captured.size} (the "
                "tree did not only append to it)")
    return ""


def refuse_shared(
    record: CheckpointRecord, shared: Sequence[SharedFile], policy: str
) -> None:
    """Raise ``PreconditionFailed`` for the first captured file its live writer(s) forbid
    to restore under ``policy`` (``shared_refusal``), naming the writer's pid and what to
    do."""
    by_path = {c.path: c for c in record.files}
    for sharing in shared:
        captured = by_path.get(sharing.path)
        why = shared_refusal(sharing, captured, policy) if captured is not None else ""
        if why:
            pids = " ".join(str(pid) for pid, _ in sharing.writers)
            raise PreconditionFailed(
                f"cannot restore {record.id}: {why}",
                hint=f"nothing was changed; stop pid {pids} (or have it close the file), then "
                     "restore again; or set shared_files = \"roll-back\" in the daemon's "
                     "configuration to roll it back all the same (its version kept aside)",
                checkpoint_id=record.id, pid=sharing.writers[0][0])


def planned(file: WrittenFile) -> CapturedFile:
    """What a dump will capture of ``file`` (for a preview: no content, no hash yet)."""
    return CapturedFile(path=file.path, size=file.size, mode=0, uid=0, gid=0, hash="",
                        image=image_name(file.path))


def aside_path(path: str, op_id: str) -> str:
    return f"{path}.ckptd-{op_id}"


_FULL = (errno.ENOSPC, errno.EDQUOT)
_RACED = (errno.EEXIST, errno.ESTALE, errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR,
          errno.EXDEV, errno.ENOTEMPTY)
_UNDONE = "the restore is undone, every file as it was found"


def put_back_failed(path: str, exc: OSError) -> PreconditionFailed:
    """One line for a file that could not be put back (``exc``, from the port): what was
    wrong and what to do, never ``[Errno N]``. A port's refusal (a message of its own that
    names the file) is kept as it is; a full file system, a file or directory changed while
    it was put back (a name that appeared, a link or directory swapped in, a file gone), a
    read-only file system and a denied write each say so. The restore is then undone."""
    said = " ".join(str(exc.strerror or exc).split())
    why = said[:1].lower() + said[1:]
    name = f" ({os.fsdecode(exc.filename)})" if exc.filename else ""
    if said.startswith("cannot put back"):
        return PreconditionFailed(said, hint=f"{_UNDONE}; restore again once that is fixed")
    if exc.errno in _FULL:
        return PreconditionFailed(
            f"cannot put back {path}: {why} on its file system (the version found is "
            "copied aside beside it first, then the checkpoint's written)",
            hint=f"{_UNDONE}; free space there (or raise the quota) and restore again")
    if exc.errno in _RACED:
        return PreconditionFailed(
            f"cannot put back {path}: it or its directory changed while it was put back "
            f"({why}{name})",
            hint=f"{_UNDONE}; stop what changes it (another process of the job's user) and "
            "restore again")
    if exc.errno == errno.EROFS:
        return PreconditionFailed(f"cannot put back {path}: its file system is read-only",
                                  hint=f"{_UNDONE}; make it writable and restore again")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PreconditionFailed(
            f"cannot put back {path}: {why}{name} for the job's owner",
            hint=f"{_UNDONE}; make it writable by the job's owner and restore again")
    return PreconditionFailed(f"cannot put back {path}: {why}{name}",
                              hint=f"{_UNDONE}; restore again once that is fixed")


def _aside_of(aside: str, path: str) -> bool:
    """``aside`` is named as a copy of ``path`` kept aside (``aside_path``) beside it."""
    rest = aside[len(path):]
    return aside.startswith(path) and rest.startswith(".ckptd-") and "/" not in rest


@dataclass
class PutBackAll:
    """Every captured file of a checkpoint put back, in order; ``undo`` reverses them all.

    Invariant: before each effect on a file exists (its aside, a created file), its
    ``UndoPutBack`` is in ``undo_log`` (when there is one): a daemon killed during the
    put-back has its successor finish the undo (``core.rollback``). Once the restore stands,
    each copy it kept aside is recorded in ``asides`` (``prune``): only recorded copies are
    ever removed on request (``ckptctl asides``)."""

    files: JobFiles
    record: CheckpointRecord
    undo_log: UndoLog | None = None
    root: Member = (0, 0)
    """The container's init whose root the files are put back in ((0, 0): the node's)."""
    asides: AsideLog | None = None
    made: float = 0.0
    """When the restore put the files back (the copies' records say so)."""
    shared_files: str = KEEP
    """A captured file a process outside the tree writes now (``JobFiles.shared``, looked
    up once, just before the first file is put back): ``keep`` it as found (``left``),
    ``refuse`` the restore, or ``roll-back`` it as any other."""
    done: list[PutBack] = field(default_factory=list)
    put_back: list[str] = field(default_factory=list)
    launchers: tuple[int, ...] = ()
    """The restore's caller and its ancestors: not other writers (``Restore.launchers``)."""
    left: list[str] = field(default_factory=list)
    """Files left as found under a live writer, "PATH (written by pid N (command))"."""
    op_id: str = ""
    _recorded: bool = field(default=False, init=False)

    def run(self, images_dir: Path, op_id: str) -> None:
        self.op_id = op_id
        uid, gid = self._owner()
        keep: set[str] = set()
        if self.shared_files != ROLL_BACK:  # the tree does not exist yet: only launchers
            shared = self.files.shared(self.record.files, self.launchers)
            refuse_shared(self.record, shared, self.shared_files)
            for sharing in shared:
                keep.add(sharing.path)
                self.left.append(f"{sharing.path} (written by {sharing.named})")
                log.warning("restore of %s: %s: left as it is (shared_files = keep)",
                            self.record.id, shared_line(sharing))
        for index, captured in enumerate(self.record.files):
            if captured.path in keep:
                continue
            before = self._journal(f"files/{index}", uid, gid)
            try:
                result = self.files.put_back(
                    captured, images_dir / captured.image, aside_path(captured.path, op_id),
                    uid, gid, before,
                )
            except OSError as exc:
                raise put_back_failed(captured.path, exc) from exc
            if result is not None:
                self.done.append(result)
                self.put_back.append(captured.path)
                log.info("restore of %s: put back %s (%d bytes)%s", self.record.id,
                         captured.path, captured.size,
                         f", kept the version found as {result.aside}" if result.aside else "")

    def undo(self) -> None:
        uid, gid = self._owner()
        while self.done:
            done = self.done.pop()
            self.files.undo(done, uid, gid)

    def recorded(self) -> tuple[AsideRecord, ...]:
        """The copies this restore kept aside, as made (those whose identity the port told)."""
        return tuple(
            AsideRecord(path=d.aside, dev=d.dev, ino=d.aside_ino, uid=d.aside_uid,
                        restore_id=self.op_id, checkpoint_id=self.record.id,
                        owner=self.record.uid, made=self.made, in_container=self.root != (0, 0))
            for d in self.done if d.aside and d.aside_ino and d.aside_uid >= 0)

    def keep_record(self) -> None:
        """Once the restore stands, before its journal entry ends (a daemon killed then
        leaves them recorded): the copies it kept aside recorded in ``asides``, once. A
        failure is logged: the restore stands, those copies are then the user's to remove."""
        if self._recorded or self.asides is None:
            return
        self._recorded = True
        made = self.recorded()
        if not made:
            return
        try:
            self.asides.add(made)
        except (OSError, ValueError) as exc:
            log.warning("restore of %s: the copies kept aside (%s) were not recorded (%s): "
                        "`ckptctl asides --remove` will not remove them; their owner may",
                        self.record.id, ", ".join(r.path for r in made), exc)

    def prune(self, keep: int, max_age_s: float) -> tuple[str, ...]:
        """After the restore succeeded: the copies it kept aside recorded (``keep_record``,
        if not yet); then, of each file's recorded copies, those beyond the ``keep`` newest
        and those older than ``max_age_s`` removed by identity (``JobFiles.remove_aside``: a file
        merely named like a copy, or at a recorded copy's name since, is never touched) and
        their records forgotten; a failure is logged. The paths removed."""
        if self.asides is None:
            return ()
        self.keep_record()
        uid, gid = self._owner()
        here = self.root != (0, 0)
        try:
            recorded = self.asides.records()
        except (OSError, ValueError) as exc:
            log.warning("restore of %s: the copies kept aside were not pruned: their record "
                        "cannot be read (%s)", self.record.id, exc)
            return ()
        removed: list[str] = []
        done: list[AsideRecord] = []
        for captured in self.record.files:
            mine = [r for r in recorded
                    if r.in_container == here and _aside_of(r.path, captured.path)]
            doomed = mine[: max(0, len(mine) - keep)]
            if max_age_s > 0:
                doomed += [r for r in mine[len(doomed):] if self.made - r.made > max_age_s]
            for aside in doomed:
                try:
                    why = self.files.remove_aside(aside.path, aside.dev, aside.ino, aside.uid,
                                                  uid, gid)
                except OSError as exc:
                    log.warning("restore of %s: the copy kept aside %s was not pruned: %s",
                                self.record.id, aside.path, exc)
                    continue
                done.append(aside)  # removed, gone, or its name another file's now
                if why:
                    log.info("restore of %s: %s not pruned: %s", self.record.id, aside.path,
                             why)
                else:
                    removed.append(aside.path)
        if removed:
            log.info("restore of %s: removed %d older copies kept aside (aside_keep, "
                     "aside_max_age_s): %s", self.record.id, len(removed), ", ".join(removed))
        if done:
            try:
                self.asides.forget(done)
            except (OSError, ValueError) as exc:
                log.warning("restore of %s: the records of the copies pruned were not "
                            "forgotten (%s)", self.record.id, exc)
        return tuple(removed)

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(d.aside for d in self.done if d.aside)

    def _journal(self, step: str, uid: int, gid: int) -> Callable[[PutBack], None]:
        moves = iter(range(1 << 30))

        def before(done: PutBack) -> None:
            key = f"{step}/moved/{next(moves)}" if done.moved_from else step
            if self.undo_log is not None:
                self.undo_log.record(key, UndoPutBack(
                    done.path, done.aside, done.created, done.dev, done.ino, done.temp,
                    uid, gid, self.root, done.mode, done.moved_from))
            if done.moved_from:  # a rename following a rotation: its own record and undo
                self.done.append(done)  # (journaled before the file's own, undone after it)
        return before

    def _owner(self) -> tuple[int, int]:
        root = self.record.processes[0] if self.record.processes else None
        return (root.uid, root.gid) if root is not None else (self.record.uid, self.record.uid)


def check_files(
    record: CheckpointRecord, files: JobFiles | None, shared_files: str = KEEP,
    launchers: Collection[int] = (),
) -> tuple[list[str], list[str]]:
    """(blocking, notes) about putting ``record``'s captured files back on this node; a
    file a process outside the tree writes now is said so, with what ``shared_files`` makes
    a restore do about it (``PutBackAll.run`` looks again when it puts files back)."""
    blocking: list[str] = []
    notes: list[str] = []
    if not record.files:
        return blocking, notes
    if files is None:
        return [f"the checkpoint captured {len(record.files)} files but this daemon cannot "
                "put files back"], notes
    root = record.processes[0] if record.processes else None
    uid, gid = (root.uid, root.gid) if root is not None else (record.uid, record.uid)
    shared = {s.path: s for s in files.shared(record.files, launchers)}
    for captured in record.files:
        sharing = shared.get(captured.path)
        if sharing is not None:
            why = shared_refusal(sharing, captured, shared_files)
            if why:
                blocking.append(f"{why}; stop pid {sharing.writers[0][0]} or set "
                                "shared_files = \"roll-back\"")
            elif shared_files == KEEP:
                notes.append(f"{shared_line(sharing)}: a restore leaves it as it is, not as "
                             "at the checkpoint (shared_files = \"keep\")")
                continue
            else:
                notes.append(f"{shared_line(sharing)}: a restore rolls it back all the same "
                             "(shared_files = \"roll-back\"; what it wrote since is kept in "
                             "the version aside only)")
        elif captured.writers:
            notes.append(f"file {captured.path} was also written by {', '.join(captured.writers)}"
                         " outside the tree at the checkpoint; none holds it now: a restore "
                         "puts it back as any other (what such a process wrote and closed "
                         "since is in the version kept aside only)")
        check = files.check(captured, uid, gid)
        if check.problem:
            blocking.append(f"file {captured.path} cannot be put back: {check.problem}")
        elif check.differs:
            notes.append(
                f"file {captured.path} differs from the checkpoint: it is put back "
                f"({captured.size} bytes), the version found kept as "
                f"{aside_path(captured.path, '<restore id>')}"
            )
    return blocking, notes
