"""This daemon's side of a group checkpoint (two phases, driven by ``ckptd.client``).

``prepare`` starts the member's dump and returns once the tree is dumped and held (stopped,
CUDA checkpointed, images staged, nothing committed) at the dump recipe's gate; ``commit``
lets it go on (commit, then kill or resume the tree) and returns its record; ``abort`` — or
``timeout_s`` without a decision — makes the gate raise, and the recipe's rollback resumes
the tree and drops the staged images. ``prepare_restore`` is the same for restoring a group:
the member is restored and held stopped; ``commit`` lets it run, ``abort`` kills it.
``record`` writes the group record, which the coordinator does last, once every member on
every daemon committed.

Invariants: a member never waits at the gate longer than its timeout (a coordinator that
died cannot leave a job frozen); nothing of an aborted member is listed; the group is listed
only through its record.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptd.core.ports import CheckpointCatalog, GroupRecords
from ckptd.core.recipe import ProgressSink, no_progress
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    DumpRequest,
    GroupRecord,
    RestoreOutcome,
    RestoreRequest,
)
from ckptd.errors import (
    Busy,
    Cancelled,
    CheckpointNotFound,
    CkptdError,
    InvalidTarget,
    PermissionDenied,
)

Dumper = Callable[[Caller, DumpRequest, ProgressSink, Callable[[str], None]], CheckpointRecord]
Restorer = Callable[[Caller, RestoreRequest, ProgressSink, Callable[[int], None]],
                    RestoreOutcome]
MAX_HOLD_S = 600.0


@dataclass
class _Member:
    pid: int
    timeout_s: float
    uid: int = 0
    prepared: threading.Event = field(default_factory=threading.Event)
    decided: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    commit: bool = False
    checkpoint_id: str = ""
    record: Any = None
    """The dump's CheckpointRecord, or the restore's RestoreOutcome."""
    error: BaseException | None = None


class GroupStore(CheckpointCatalog, GroupRecords, Protocol):
    """What group checkpoints need of the store: its checkpoints and its group records."""


class GroupMembers:
    def __init__(
        self, dump: Dumper, store: GroupStore, restore: Restorer | None = None
    ) -> None:
        self._dump = dump
        self._restore = restore
        self._store = store
        self._groups: dict[str, list[_Member]] = {}
        self._lock = threading.Lock()

    def prepare(
        self, caller: Caller, group_id: str, request: DumpRequest, timeout_s: float = 60.0
    ) -> str:
        """Dump ``request.pid`` and hold it; returns its checkpoint id once held. Raises the
        dump's own error if it fails before the gate (the tree is then running again)."""
        member = self._hold(
            caller, group_id, request.pid, timeout_s,
            lambda gate: self._dump(caller, request, no_progress, gate),
        )
        return str(member.checkpoint_id)

    def prepare_restore(
        self, caller: Caller, group_id: str, checkpoint_id: str, timeout_s: float = 60.0
    ) -> int:
        """Restore ``checkpoint_id`` and hold the tree stopped; returns its root pid."""
        if self._restore is None:
            raise InvalidTarget("this daemon cannot restore groups")
        restore = self._restore
        member = self._hold(
            caller, group_id, 0, timeout_s,
            lambda gate: restore(caller, RestoreRequest(checkpoint_id=checkpoint_id),
                                 no_progress, gate),
        )
        return int(member.checkpoint_id)

    def _hold(
        self, caller: Caller, group_id: str, pid: int, timeout_s: float,
        operation: Callable[[Callable[[Any], None]], Any],
    ) -> _Member:
        if not group_id:
            raise InvalidTarget("a group operation needs a group id")
        timeout_s = min(max(timeout_s, 1.0), MAX_HOLD_S)
        member = _Member(pid, timeout_s, caller.uid)
        with self._lock:
            members = self._groups.setdefault(group_id, [])
            if pid and any(m.pid == pid for m in members):
                raise Busy(f"pid {pid} is already a member of group {group_id}", pid=pid)
            members.append(member)

        def gate(held: Any) -> None:
            member.checkpoint_id = str(held)
            member.prepared.set()
            if not member.decided.wait(member.timeout_s):
                raise Cancelled(
                    f"group {group_id}: no commit within {member.timeout_s:g}s; undone, "
                    "nothing kept", pid=pid or None,
                )
            if not member.commit:
                raise Cancelled(f"group {group_id} aborted; undone", pid=pid or None)

        def run() -> None:
            try:
                member.record = operation(gate)
            except BaseException as exc:
                member.error = exc
            finally:
                member.finished.set()
                member.prepared.set()

        threading.Thread(target=run, name=f"group-{group_id}", daemon=True).start()
        member.prepared.wait()
        if member.error is not None:
            self._forget(group_id, member)
            raise member.error
        return member

    def commit(self, caller: Caller, group_id: str) -> list[Any]:
        """Commit every member of ``group_id`` held here; returns their records (dumps) or
        outcomes (restores)."""
        members = self._members(caller, group_id)
        for m in members:
            m.commit = True
            m.decided.set()
        records, errors = [], []
        for m in members:
            m.finished.wait()
            if m.record is not None:
                records.append(m.record)
            elif m.error is not None:
                errors.append(m.error)
        with self._lock:
            self._groups.pop(group_id, None)
        if errors:
            first = errors[0]
            raise first if isinstance(first, CkptdError) else Cancelled(str(first))
        return records

    def abort(self, caller: Caller, group_id: str) -> int:
        """Undo every member of ``group_id`` held here; returns how many there were."""
        self._members(caller, group_id, allow_none=True)
        with self._lock:
            members = self._groups.pop(group_id, [])
        for m in members:
            m.commit = False
            m.decided.set()
        for m in members:
            m.finished.wait()
        return len(members)

    def abort_all(self) -> int:
        """Undo every member held here (the daemon is stopping); returns how many."""
        with self._lock:
            group_ids = list(self._groups)
        return sum(self.abort(Caller(uid=0), g) for g in group_ids)

    def owned_by(self, group: GroupRecord, caller: Caller) -> bool:
        """Whether ``caller`` may see or record ``group``: root, or the owner of every member
        checkpoint this daemon's store holds (at least one)."""
        if caller.is_root:
            return True
        mine = 0
        for m in group.members:
            try:
                record = self._store.get(m.checkpoint_id)
            except CkptdError:
                continue  # on another daemon's store
            if record.uid != caller.uid:
                return False
            mine += 1
        return mine > 0

    def record(self, group: GroupRecord) -> None:
        """Write ``group``'s record. Its members are not looked up: several daemons may share
        a node name (one machine, several stores), and a member's checkpoint is checked where
        it is restored."""
        self._store.put_group(group)

    def list_groups(self) -> list[GroupRecord]:
        return self._store.list_groups()

    def _members(
        self, caller: Caller, group_id: str, *, allow_none: bool = False
    ) -> list[_Member]:
        with self._lock:
            members = list(self._groups.get(group_id, []))
        for m in members:
            if not caller.is_root and m.uid != caller.uid:
                raise PermissionDenied(f"group {group_id} is not the caller's")
        if not members and not allow_none:
            raise CheckpointNotFound(f"no member of group {group_id} is prepared here",
                                     hint="it timed out or was aborted; start again")
        return members

    def _forget(self, group_id: str, member: _Member) -> None:
        with self._lock:
            members = self._groups.get(group_id, [])
            if member in members:
                members.remove(member)
            if not members:
                self._groups.pop(group_id, None)
