"""``Undoer``: the one implementation of every undo that must outlive the daemon's process.

The recipes call it for their in-process rollback (on held handles they already have), and
``CheckpointService.recover`` for a killed daemon's operations (``replay``: the journaled
records of ``core.undo``, newest first, on handles reopened with the recorded start times).
So "kill the stopped tree", "resume the tree", "bring CUDA back" are each written once.

Invariants: a process is signalled only through a handle opened on the process recorded (its
start time checked; one recorded without start time only while it is stopped, as CRIU left
it); a record's failure is logged and named in the summary, never stops the others; replay
waits (bounded) for a CRIU the killed daemon started to let go of the tree before deciding.
"""

from __future__ import annotations

import logging
import signal
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.config import CoreConfig
from ckptd.core.gpu import GpuSession, GpuSteps
from ckptd.core.held import HeldTree
from ckptd.core.ports import CheckpointStore, Clock, JobFiles, ProcessLookup, PutBack
from ckptd.core.undo import (
    AbortStaging,
    Entry,
    GuardResumed,
    InDoubt,
    KillTree,
    Member,
    RemoveOutput,
    RestoreHere,
    ResumeCuda,
    ResumeTree,
    Undo,
    UndoPutBack,
    tree_members,
)
from ckptd.domain import Caller, PidState, RestoreOutcome, RestoreRequest
from ckptd.errors import CkptdError

log = logging.getLogger(__name__)

RestoreHereFn = Callable[[Caller, RestoreRequest], RestoreOutcome]


class BackHere:
    """The undo of a migration whose dump killed the tree here: the one implementation, run
    by the migrate recipe in-process and by ``Undoer.replay`` for a killed daemon's entry.
    ``RestoreHere``: the tree restored on this node from its checkpoint (as the record's
    uid); ``InDoubt``: nothing restored (the target may run it), the note says where to look.
    Each returns the note a caller adds to its error or summary; a failed restore here is a
    note too (the checkpoint stays)."""

    def __init__(self, restore_here: RestoreHereFn | None) -> None:
        self.restore_here = restore_here

    def restore(self, undo: RestoreHere,
                caller: Caller | None = None) -> tuple[RestoreOutcome | None, str]:
        """``caller``: who asked for the migration, when it is still known (in-process: the
        tree goes where its restore would put it); else the record's uid."""
        if self.restore_here is None:
            return None, f"not restored here: `ckptctl restore {undo.checkpoint_id}`"
        try:
            outcome = self.restore_here(
                caller or Caller(uid=undo.uid), RestoreRequest(checkpoint_id=undo.checkpoint_id))
        except CkptdError as exc:
            return None, (f"restoring it on this node failed too ({exc.message}); its "
                          f"checkpoint is kept: `ckptctl restore {undo.checkpoint_id}`")
        return outcome, (f"the tree was restored on this node as pid {outcome.pid} from "
                         f"{undo.checkpoint_id}")

    @staticmethod
    def in_doubt(undo: InDoubt, why: str, pid: int = 0) -> str:
        """``why``: what happened while the target was restoring ("the link broke")."""
        which = f"pid {pid} runs" if pid else "it runs"
        return (f"{why} while {undo.to} was restoring: check there whether {which}; if not, "
                f"`ckptctl restore {undo.checkpoint_id}` here")


@dataclass
class _Replay:
    """What one replay did, for its summary line."""

    committed: dict[str, bool] = field(default_factory=dict)
    killed: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    tree: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped_before: frozenset[int] = frozenset()
    """The pids the entry's ResumeTree records leave stopped (stopped before the dump)."""


class Undoer:
    def __init__(
        self,
        *,
        processes: ProcessLookup,
        store: CheckpointStore,
        clock: Clock,
        config: CoreConfig,
        gpu: GpuSteps | None = None,
        restore_here: RestoreHereFn | None = None,
        files: JobFiles | None = None,
    ) -> None:
        self._processes = processes
        self._store = store
        self._clock = clock
        self._config = config
        self._gpu = gpu
        self.back_here = BackHere(restore_here)
        self._files = files

    # ---- shared with the recipes' in-process rollback -------------------------------------

    @staticmethod
    def resume_tree(held: HeldTree, stopped_before: Iterable[int] = ()) -> list[int]:
        """SIGCONT every held process stopped now, except those stopped before."""
        return held.resume(frozenset(stopped_before))

    def kill_tree(
        self, held: HeldTree, *, only_stopped: bool = False,
        unverified: frozenset[int] = frozenset(), wait_s: float = 0.0,
    ) -> list[int]:
        """SIGKILL the held processes (with ``only_stopped``, and for ``unverified`` ones
        whatever the flag, only those stopped now); with ``wait_s``, wait until each killed
        one is dead (zombie or gone) and log those that are not. Returns those signalled."""
        targets = [p for p in held.pids
                   if not ((only_stopped or p in unverified)
                           and held.state(p) is not PidState.STOPPED)]
        killed = [p for p in targets if held.signal(p, signal.SIGKILL)]
        if wait_s > 0 and killed:
            alive = held.wait_exit(killed, wait_s, self._clock)
            if alive:
                log.error("pids %s still alive %.0fs after SIGKILL", alive, wait_s)
        return killed

    def resume_cuda(
        self, pids: Sequence[int], gpu_map: dict[str, str] | None = None, *,
        held: HeldTree | None = None, stopped_before: frozenset[int] = frozenset(),
    ) -> None:
        """Whatever state the driver was left in, CUDA of ``pids`` back to RUNNING, each
        process held but its restore thread (``GpuSteps.resume``, docs/adr/0019). With
        ``held`` (the processes, stopped or not), those of ``pids`` stopped now and not in
        ``stopped_before`` are SIGCONTed once held: only their restore threads run until
        their CUDA is back. Raises the first failure (after trying every process)."""
        if not pids or self._gpu is None:
            return
        cont = None
        if held is not None:
            def cont() -> None:
                for pid in pids:
                    if pid not in stopped_before and held.state(pid) is PidState.STOPPED:
                        held.signal(pid, signal.SIGCONT)

        self._gpu.resume(GpuSession(cuda_pids=tuple(pids), locked=list(pids),
                                    checkpointed=list(pids)), gpu_map, cont=cont)

    def undo_put_back(self, undo: UndoPutBack) -> None:
        """A file as the restore found it (``UndoPutBack``), in the root it was put back in.
        Raises when it cannot be (the file's container gone, its directory changed)."""
        if self._files is None:
            raise RuntimeError(f"this daemon cannot put files back ({undo.path})")
        files = self._files
        pid, start = undo.root
        if pid:
            handle = self._processes.open(pid, start)
            if handle is None:
                raise RuntimeError(f"the container of {undo.path} (init pid {pid}) is gone")
            handle.close()
            files = files.seen_by(pid)
        files.undo(PutBack(undo.path, undo.aside, undo.created, undo.dev, undo.ino, undo.temp,
                           undo.mode, undo.moved_from), undo.uid, undo.gid)

    @staticmethod
    def remove_output(undo: RemoveOutput) -> bool:
        """The restore's own output file removed if it is still an empty regular file (never
        followed through a link). Whether it was."""
        path = Path(undo.path)
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != 0:
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    # ---- recovery --------------------------------------------------------------------------

    def replay(self, entry: Entry) -> str:
        """Run ``entry``'s records newest first — but CUDA before the tree: each ResumeCuda
        runs before the entry's ResumeTree (``_cuda_first``), so the CUDA processes come
        back held, the tree still stopped, and only then does the tree run (docs/adr/0019).
        One line saying what was done ("" when the entry records nothing)."""
        if not entry.undos:
            return ""
        done = _Replay(stopped_before=frozenset(
            p for u in entry.undos if isinstance(u, ResumeTree) for p in u.stopped_before))
        self._wait_untraced(tree_members(entry.undos))
        for undo in _cuda_first(entry.undos):
            try:
                self._run(undo, done)
            except Exception as exc:
                log.exception("recovery: %s failed", undo.kind)
                done.notes.append(f"{undo.kind} failed: {exc}")
        if entry.op == "dump" and entry.checkpoint_id:
            # for the summary: a leave-running dump's records do not depend on its commit
            self._committed(entry.checkpoint_id, done)
        return _summary(entry, done)

    def _run(self, undo: Undo, done: _Replay) -> None:
        if isinstance(undo, AbortStaging):
            self._store.abort(undo.checkpoint_id)  # its staging and lease; never a commit
        elif isinstance(undo, KillTree):
            if undo.if_committed and not self._committed(undo.if_committed, done):
                return
            with self._reopen(undo.members) as held:
                done.killed += self.kill_tree(  # dead before older records (files) run
                    held, only_stopped=undo.only_stopped, unverified=_unverified(undo.members),
                    wait_s=self._config.zombie_wait_s)
        elif isinstance(undo, ResumeTree):
            if undo.unless_committed and self._committed(undo.unless_committed, done):
                return
            with self._reopen(undo.members) as held:
                done.tree = held.pids
                done.resumed += self.resume_tree(held, undo.stopped_before)
        elif isinstance(undo, ResumeCuda):
            if undo.unless_committed and self._committed(undo.unless_committed, done):
                return
            with self._reopen(undo.members) as held:  # the tree still stopped: held, each
                self.resume_cuda([p for p, _ in undo.members if p in held],  # continued
                                 held=held, stopped_before=done.stopped_before)
        elif isinstance(undo, RestoreHere):
            self._restore_here(undo, done)
        elif isinstance(undo, GuardResumed):
            self._guard_resumed(undo, done)
        elif isinstance(undo, UndoPutBack):
            self.undo_put_back(undo)
            done.notes.append(f"{undo.path} as found")
        elif isinstance(undo, RemoveOutput):
            if self.remove_output(undo):
                done.notes.append(f"{undo.path} removed (empty)")
        elif isinstance(undo, InDoubt):
            done.notes.append(BackHere.in_doubt(undo, "the daemon died"))

    def _guard_resumed(self, undo: GuardResumed, done: _Replay) -> None:
        """The guard resumed the tree while the commit was unsure (docs/adr/0016): a
        checkpoint that did get committed goes, the tree having run on, and counts as never
        committed for the older records (nothing killed; tree and CUDA resumed)."""
        committed = self._committed(undo.checkpoint_id, done)
        done.committed[undo.checkpoint_id] = False  # even if the delete fails: never killed
        done.notes.append("its guard resumed the tree while the commit was under way")
        if committed:
            self._store.delete(undo.checkpoint_id)
            done.notes.append("the committed checkpoint was deleted")

    def _restore_here(self, undo: RestoreHere, done: _Replay) -> None:
        if not self._committed(undo.checkpoint_id, done):
            done.notes.append("its checkpoint was never committed: the tree was not killed")
            return
        done.notes.append(self.back_here.restore(undo)[1])

    def _committed(self, checkpoint_id: str, done: _Replay) -> bool:
        if checkpoint_id not in done.committed:
            done.committed[checkpoint_id] = any(
                r.id == checkpoint_id for r in self._store.list())
        return done.committed[checkpoint_id]

    def _reopen(self, members: Sequence[Member]) -> HeldTree:
        return HeldTree.from_members(self._processes, [[p, s] for p, s in members])

    def _wait_untraced(self, pids: Sequence[int]) -> None:
        """A CRIU started by the killed daemon may still hold the tree (ptrace); it finishes
        or gives up on its own. Wait for it (bounded) before deciding anything."""
        deadline = self._clock.monotonic() + self._config.recovery_wait_s
        while any(self._processes.status(p).traced for p in pids):
            if self._clock.monotonic() >= deadline:
                log.error("recovery: pids %s still traced after %.0fs", list(pids),
                          self._config.recovery_wait_s)
                return
            self._clock.sleep(0.1)


def _cuda_first(undos: Sequence[Undo]) -> list[Undo]:
    """``undos`` newest first, every ResumeCuda moved just before the first ResumeTree (a
    dump's ResumeTree is newer than its ResumeCuda: replayed as written, the tree would run
    before its CUDA is back)."""
    ordered = list(reversed(undos))
    cuda = [u for u in ordered if isinstance(u, ResumeCuda)]
    rest = [u for u in ordered if not isinstance(u, ResumeCuda)]
    at = next((i for i, u in enumerate(rest) if isinstance(u, ResumeTree)), None)
    if not cuda or at is None:
        return ordered
    return rest[:at] + cuda + rest[at:]


def _unverified(members: Sequence[Member]) -> frozenset[int]:
    return frozenset(p for p, start in members if not start)


def _summary(entry: Entry, done: _Replay) -> str:
    ck = entry.checkpoint_id
    notes = "".join(f"; {n}" for n in done.notes)
    if entry.op == "dump":
        if done.committed.get(ck):
            return f"finished dump {ck}: it was committed" + notes
        return (f"rolled back dump {ck}: nothing listed, tree {done.tree} resumed "
                f"(SIGCONT to {done.resumed or 'none'})" + notes)
    if entry.op == "held-restore":
        return f"undid held group restore of {ck}: killed {done.killed or 'nothing'}" + notes
    if entry.op == "restore":
        return (f"undid interrupted restore of {ck}: killed {done.killed or 'nothing'}, "
                "its checkpoint kept" + notes)
    if entry.op == "migrate":
        return f"migration of {ck or 'a tree'} interrupted" + notes
    return f"undid {entry.op or 'an operation'} {ck}".rstrip() + notes
