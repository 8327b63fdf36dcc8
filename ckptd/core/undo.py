"""Typed, durable undo records: what a restarted daemon does about an operation in flight.

Each step of a recipe whose effect outlives the daemon's process (a staged checkpoint, a
frozen tree, locked CUDA, a killed tree whose checkpoint must come back) names that effect's
undo as one of the records below. The recipe writes it to the journal (``UndoLog``) *before*
the effect can exist, so:

    Invariant: whenever an effect of an operation exists, its undo is durable.

A killed daemon's successor reads the interrupted operation's records (``decode_entry``) and
runs them newest first through ``core.rollback.Undoer``, the same code the recipes use for
their in-process rollback. Every record is safe to run whether or not its effect happened
(an undo tolerates a partial or absent ``do``) and safe to run twice.

Some records depend on the commit point of a dump (docs/adr/0002): a record with
``unless_committed`` is skipped once that checkpoint is committed (the dump finishes forward),
one with ``if_committed`` runs only then (it *is* the finishing: killing the dumped tree).

The journal entry of an operation (``Journal.begin`` facts, JSON)::

    {"version": 2, "op": "dump" | "restore" | "held-restore" | "migrate",
     "checkpoint_id": "...", "undo": [{"step": NAME, "kind": KIND, ...fields}, ...]}

A migration target's restore ends its entry into a ``Received`` record (op "received", kept:
what the target answers its source, ``core.receive``) instead of forgetting it.

The dump's guard (docs/adr/0016), once the daemon is dead, may append one record of its own
(``with_guard_resumed``) before it resumes a tree whose commit was unsure.

An entry without ``version`` was written by a daemon before typed undos (``legacy_undos``).
Process members are ``(pid, start time)``; start time 0 means "unknown" (legacy entries): such
a process is acted on only while stopped, as CRIU left it (docs/adr/0008).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptd.core.ports import Journal

log = logging.getLogger(__name__)

VERSION = 2
"""The journal entry format with typed undo records (1: the untyped facts of old daemons)."""

Member = tuple[int, int]
"""A process as recorded: its pid (the daemon's namespace) and its start time (0: unknown)."""


@dataclass(frozen=True)
class AbortStaging:
    """Forget the uncommitted staging (images, lease) of ``checkpoint_id``; a committed
    checkpoint is never touched (``CheckpointStore.abort`` is idempotent)."""

    kind: ClassVar[str] = "abort-staging"
    checkpoint_id: str


@dataclass(frozen=True)
class ResumeCuda:
    """Bring the CUDA state of ``members`` back to RUNNING (restore if checkpointed, unlock
    if locked), after their tree runs again."""

    kind: ClassVar[str] = "resume-cuda"
    members: tuple[Member, ...]
    unless_committed: str = ""


@dataclass(frozen=True)
class ResumeTree:
    """SIGCONT every process of ``members`` stopped now that was not stopped before the
    operation (``stopped_before``, pids)."""

    kind: ClassVar[str] = "resume-tree"
    members: tuple[Member, ...]
    stopped_before: tuple[int, ...] = ()
    unless_committed: str = ""


@dataclass(frozen=True)
class KillTree:
    """SIGKILL ``members`` (with ``only_stopped``, only those still stopped: a held tree its
    group never let run)."""

    kind: ClassVar[str] = "kill-tree"
    members: tuple[Member, ...]
    only_stopped: bool = False
    if_committed: str = ""


@dataclass(frozen=True)
class RestoreHere:
    """A migration killed its tree here after committing ``checkpoint_id``: restore it on
    this node (as ``uid``) unless it never was committed."""

    kind: ClassVar[str] = "restore-here"
    checkpoint_id: str
    uid: int
    to: str = ""


@dataclass(frozen=True)
class InDoubt:
    """A migration was finishing on ``to``: the target may run the tree already, so nothing
    is restored here until the target says it did not (``core.settle``: asked until it
    answers); the checkpoint stays. ``uid``: whose tree (-1 in entries of daemons before
    settlement, which are left to the operator); ``since``: when (wall clock) the target
    began restoring."""

    kind: ClassVar[str] = "in-doubt"
    checkpoint_id: str
    to: str
    uid: int = -1
    since: float = 0.0


@dataclass(frozen=True)
class GuardResumed:
    """Written by the dump's guard, not by a recipe (docs/adr/0016): the daemon died while
    the commit of ``checkpoint_id`` was under way and the guard resumed the killing dump's
    tree. Being the newest record it runs first: a checkpoint that did get committed is
    deleted (the tree ran on, as when a step after the commit fails), so the records that
    depend on the commit then see it uncommitted (``KillTree`` skipped, the tree and its CUDA
    resumed)."""

    kind: ClassVar[str] = "guard-resumed"
    checkpoint_id: str


@dataclass(frozen=True)
class UndoPutBack:
    """A file a restore put back (or was about to), made again as the restore found it
    (``JobFiles.undo``: its temporary removed, the version kept aside copied back into that
    very file, a file it created removed), acting as ``uid``/``gid``, in the root file
    system of ``root`` (a container's init; ``(0, 0)``: the node's). Journaled before each
    effect of the put-back exists (``core.jobfiles``)."""

    kind: ClassVar[str] = "undo-put-back"
    path: str
    aside: str
    created: bool
    dev: int
    ino: int
    temp: str
    uid: int
    gid: int
    root: Member = (0, 0)
    mode: int = 0
    moved_from: str = ""


@dataclass(frozen=True)
class RemoveOutput:
    """The output file ckptd chose for a restore's stdio (``path``, in its output
    directory), removed while it is an empty regular file: nothing of the tree wrote to it.
    A file the caller named is never recorded."""

    kind: ClassVar[str] = "remove-output"
    path: str


Undo = (AbortStaging | ResumeCuda | ResumeTree | KillTree | RestoreHere | InDoubt | GuardResumed
        | UndoPutBack | RemoveOutput)
KINDS: dict[str, type[Undo]] = {
    c.kind: c for c in (AbortStaging, ResumeCuda, ResumeTree, KillTree, RestoreHere, InDoubt,
                        GuardResumed, UndoPutBack, RemoveOutput)
}

RECEIVED = "received"
"""The op of a migration target's record of what it did with a checkpoint it was sent
(``Received``): not an operation in flight, kept by recovery (pruned when old)."""


def received_op_id(checkpoint_id: str) -> str:
    """The journal entry of a target's restore of a migrated ``checkpoint_id``, which its end
    turns into the ``Received`` record (one atomic replace)."""
    return f"v-{checkpoint_id}"


@dataclass(frozen=True)
class Received:
    """A migration target's durable answer for ``checkpoint_id``: ``restored`` (its restore
    let the tree run, as ``pid``), or not (a fence: written when the source asked and no
    restore of it was under way or done; a fenced checkpoint is never restored here). ``time``
    (wall clock) lets recovery prune old records."""

    checkpoint_id: str
    restored: bool
    pid: int = 0
    output_path: str = ""
    time: float = 0.0

    def facts(self) -> dict[str, Any]:
        return {"version": VERSION, "op": RECEIVED, "checkpoint_id": self.checkpoint_id,
                "restored": self.restored, "pid": self.pid, "output_path": self.output_path,
                "time": self.time, "undo": []}

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> Received | None:
        """The record a journal entry holds; None for an entry that is not one."""
        if facts.get("op") != RECEIVED or facts.get("version") != VERSION:
            return None
        try:
            return cls(str(facts["checkpoint_id"]), bool(facts["restored"]),
                       int(facts.get("pid", 0)), str(facts.get("output_path", "")),
                       float(facts.get("time", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None


GUARD_STEP = "guard"
"""The step name the guard's record is journaled under (no recipe step has it)."""


@dataclass(frozen=True)
class Entry:
    """One operation in flight, as a restarted daemon reads it back."""

    op: str
    checkpoint_id: str
    undos: tuple[Undo, ...]
    version: int = VERSION


class BadEntry(ValueError):
    """A journal entry that cannot be read back as undo records."""


# ---- encoding ---------------------------------------------------------------------------------


def encode(step: str, undo: Undo) -> dict[str, Any]:
    fields = {f.name: _plain(getattr(undo, f.name)) for f in dataclasses.fields(undo)}
    return {"step": step, "kind": undo.kind, **fields}


def decode(data: dict[str, Any]) -> Undo:
    """One record; raises BadEntry (its cause kept) when it is not one."""
    kind = data.get("kind")
    cls = KINDS.get(str(kind))
    if cls is None:
        raise BadEntry(f"unknown undo kind {kind!r}")
    try:
        args = {f.name: _typed(f.name, data[f.name]) for f in dataclasses.fields(cls)
                if f.name in data}
        return cls(**args)
    except (TypeError, ValueError, KeyError) as exc:
        raise BadEntry(f"bad {kind} record {data!r}: {exc}") from exc


def decode_entry(facts: dict[str, Any]) -> Entry:
    """The entry a journal holds, typed; an entry of an old daemon through ``legacy_undos``.
    Raises BadEntry for one that is neither."""
    if "version" not in facts:
        return Entry(str(facts.get("op", "")), str(facts.get("checkpoint_id", "")),
                     legacy_undos(facts), version=1)
    if facts["version"] != VERSION:
        raise BadEntry(f"journal entry of version {facts['version']!r} (this daemon reads "
                       f"{VERSION})")
    undos = facts.get("undo", [])
    if not isinstance(undos, list):
        raise BadEntry(f"undo list expected, got {undos!r}")
    return Entry(str(facts.get("op", "")), str(facts.get("checkpoint_id", "")),
                 tuple(decode(u) for u in undos))


def with_guard_resumed(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` (a typed dump entry) with ``GuardResumed`` appended: what the guard writes,
    once the daemon is dead, before it resumes a tree whose commit was unsure. Raises
    BadEntry for an entry that is not a typed dump entry (nothing is written then, and the
    guard leaves the tree to the next start)."""
    entry = decode_entry(facts)
    if entry.version != VERSION or entry.op != "dump" or not entry.checkpoint_id:
        raise BadEntry(f"not a typed dump entry: {facts!r}")
    undos = [u for u in facts["undo"] if u.get("step") != GUARD_STEP]
    return {**facts, "undo": [*undos, encode(GUARD_STEP, GuardResumed(entry.checkpoint_id))]}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _typed(name: str, value: Any) -> Any:
    if name == "members":
        return members_of(value)
    if name in ("stopped_before",):
        return tuple(int(p) for p in value)
    if name in ("uid", "gid", "dev", "ino", "mode"):
        return int(value)
    if name == "since":
        return float(value)
    if name in ("only_stopped", "created"):
        return bool(value)
    if name == "root":
        return (int(value[0]), int(value[1]))
    return str(value)


def members_of(entries: Iterable[Any]) -> tuple[Member, ...]:
    """``[pid, start]`` pairs (or bare pids: start time unknown) as members."""
    out: list[Member] = []
    for entry in entries:
        if isinstance(entry, list | tuple):
            out.append((int(entry[0]), int(entry[1])))
        else:
            out.append((int(entry), 0))
    return tuple(out)


def legacy_undos(facts: dict[str, Any]) -> tuple[Undo, ...]:
    """The undo records equivalent to an untyped entry of a daemon before typed undos
    (``{"op": "dump", "pids", "members", "stopped_before", "leave_running", "cuda_pids"}``
    or ``{"op": "held-restore", "pids", "members"}``), in step order. Any other op: none."""
    op = facts.get("op")
    members = members_of(facts.get("members") or facts.get("pids") or [])
    if op == "held-restore":
        return (KillTree(members, only_stopped=True),)
    if op != "dump":
        return ()
    ckpt = str(facts.get("checkpoint_id", ""))
    killing = not bool(facts.get("leave_running", False))
    by_pid = dict(members)
    cuda = tuple((int(p), by_pid.get(int(p), 0)) for p in facts.get("cuda_pids", []))
    undos: list[Undo] = [AbortStaging(ckpt)]
    if cuda:
        undos.append(ResumeCuda(cuda, unless_committed=ckpt if killing else ""))
    undos.append(ResumeTree(members, tuple(int(p) for p in facts.get("stopped_before", [])),
                            unless_committed=ckpt))
    if killing:
        undos.append(KillTree(members, if_committed=ckpt))
    return tuple(undos)


# ---- the log of one operation -----------------------------------------------------------------


class UndoLog:
    """The durable undo records of one operation (``op_id`` in the journal).

    ``record`` writes the whole entry again (the journal replaces it atomically) before it
    returns: call it before the effect it undoes can exist. A step records at most one undo;
    recording again under the same step replaces it in place (a step that learns more, e.g.
    the pids CRIU actually froze). ``end`` forgets the operation; ``end(done=True)`` (it
    succeeded) writes ``kept`` in its place when set, in one atomic replace (a migration
    target's ``Received``: never a moment where neither the undo nor the record is there).
    Not thread-safe: one operation owns it."""

    def __init__(self, journal: Journal | None, op_id: str, op: str, checkpoint_id: str = ""):
        self._journal = journal
        self.op_id = op_id
        self.op = op
        self.checkpoint_id = checkpoint_id
        self._steps: dict[str, Undo] = {}
        self.begun = False
        self.kept: dict[str, Any] | None = None
        """The entry left when the operation succeeded (``end(done=True)``)."""

    @property
    def undos(self) -> tuple[Undo, ...]:
        return tuple(self._steps.values())

    def begin(self) -> None:
        """Record the operation as in flight (no undo yet)."""
        self._write()

    def record(self, step: str, undo: Undo) -> None:
        self._steps[step] = undo
        self._write()

    def end(self, done: bool = False) -> None:
        if self._journal is not None and done and self.kept is not None:
            self._journal.begin(self.op_id, self.kept)
        elif self._journal is not None and self.begun:
            self._journal.end(self.op_id)
        self.begun = False

    def facts(self) -> dict[str, Any]:
        return {"version": VERSION, "op": self.op, "checkpoint_id": self.checkpoint_id,
                "undo": [encode(step, undo) for step, undo in self._steps.items()]}

    def _write(self) -> None:
        if self._journal is None:
            return
        self._journal.begin(self.op_id, self.facts())
        self.begun = True


def tree_members(undos: Sequence[Undo]) -> list[int]:
    """Every pid some record acts on (to wait for a CRIU still tracing them)."""
    pids: dict[int, None] = {}
    for undo in undos:
        if isinstance(undo, ResumeTree | KillTree | ResumeCuda):
            pids.update(dict.fromkeys(p for p, _ in undo.members))
    return list(pids)
