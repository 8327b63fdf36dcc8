"""``ckptd.client``: a Python client of ckptd daemons, for schedulers and tools.

``Daemon`` talks to one daemon's API over its Unix socket (the scheduler's node agent, or
anything on the node). ``group_checkpoint`` and ``group_restore`` drive a group — every
process of a distributed job, on one or several daemons — all-or-nothing:

    checkpoint:  prepare every member (dumped and held stopped, nothing committed)
                 -> all prepared: commit every member -> record the group on every daemon
                 -> any failure before the commits: abort every member (each one resumed,
                    nothing listed) and raise GroupError naming what failed
    restore:     restore every member held stopped -> all held: let them all run
                 -> any failure: kill every restored member and raise GroupError

A member never waits longer than ``hold_s`` for the decision: a coordinator that dies leaves
no job frozen (its daemon resumes it and keeps nothing). A group is listed (``list_groups``)
only through its record, written after every member's checkpoint is committed.

    from ckptd.client import Daemon, group_checkpoint
    a, b = Daemon("/run/ckptd/ckptd.sock"), Daemon("/mnt/node-b/run/ckptd/ckptd.sock")
    group = group_checkpoint([(a, 4711), (b, 4712)], name="llm-ft")
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc as pb_grpc
from ckptd._gen.ckptd.v1 import peer_pb2_grpc
from ckptd.domain import GroupMember, GroupRecord
from ckptd.transport.grpc import convert
from ckptd.transport.grpc.peer import CHANNEL_OPTIONS, TlsFiles

T = TypeVar("T")
DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


class GroupError(Exception):
    """A group operation failed and was undone. ``errors``: one line per failed member."""

    def __init__(self, message: str, errors: Sequence[str]) -> None:
        super().__init__(f"{message}: " + "; ".join(errors))
        self.errors = tuple(errors)


class Daemon:
    """One daemon: by its Unix socket path (its local API), or by ``host:port`` of its peer
    listener with ``tls`` (a certificate of the daemons' CA; group operations only there).
    Calls raise ``grpc.RpcError`` with the daemon's one-line message (``err.details()``)."""

    def __init__(
        self, address: str = DEFAULT_SOCKET, *, tls: TlsFiles | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.stub: Any
        if tls is not None:
            self.address = address
            self._channel = grpc.secure_channel(address, tls.channel_credentials(),
                                                options=CHANNEL_OPTIONS)
            self.stub = peer_pb2_grpc.PeerStub(self._channel)  # type: ignore[no-untyped-call]
        else:
            self.address = address if address.startswith("unix:") else f"unix:{address}"
            self._channel = grpc.insecure_channel(self.address)
            self.stub = pb_grpc.CheckpointerStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def node(self) -> str:
        return str(self.stub.Check(pb.CheckRequest(), timeout=self.timeout_s).node)

    def list_groups(self) -> list[GroupRecord]:
        response = self.stub.ListGroups(pb.ListGroupsRequest(), timeout=self.timeout_s)
        return [convert.group_from(g) for g in response.groups]

    def checkpoints(self, name: str = "") -> list[pb.Checkpoint]:
        return list(self.stub.List(pb.ListRequest(name=name), timeout=self.timeout_s)
                    .checkpoints)


@dataclass(frozen=True)
class _Held:
    daemon: Daemon
    value: Any


def _each(calls: Sequence[Callable[[], T]]) -> list[T | BaseException]:
    """Run ``calls`` in parallel; each result, or the exception it raised."""
    def safe(call: Callable[[], T]) -> T | BaseException:
        try:
            return call()
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        return list(pool.map(safe, calls))


def _on_each(daemons: Sequence[Daemon], fn: Callable[[Daemon], T]) -> list[T | BaseException]:
    return _each([functools.partial(fn, d) for d in daemons])


def _abort(group_id: str) -> Callable[[Daemon], Any]:
    return lambda d: d.stub.GroupAbort(pb.GroupAbortRequest(group_id=group_id),
                                       timeout=d.timeout_s)


def _commit(group_id: str) -> Callable[[Daemon], Any]:
    return lambda d: d.stub.GroupCommit(pb.GroupCommitRequest(group_id=group_id),
                                        timeout=d.timeout_s)


HOLD_MARGIN = 0.2
"""The commit must start within (1 - HOLD_MARGIN) x hold_s of the first prepare: every member
is then surely still held (each one's wait began after that first prepare)."""


def _too_slow(started: float, hold_s: float) -> list[str]:
    took = time.monotonic() - started
    if took <= hold_s * (1 - HOLD_MARGIN):
        return []
    return [f"the members took {took:.0f}s to prepare, too close to hold_s={hold_s:g}s for "
            "every one to be still held; give a larger hold_s"]


def _text(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)


def _distinct(daemons: Sequence[Daemon]) -> list[Daemon]:
    seen: dict[str, Daemon] = {}
    for d in daemons:
        seen.setdefault(d.address, d)
    return list(seen.values())


def group_checkpoint(
    members: Sequence[tuple[Daemon, int]],
    *,
    name: str = "",
    leave_running: bool = False,
    hold_s: float = 60.0,
) -> GroupRecord:
    """Checkpoint every ``(daemon, pid)`` all-or-nothing; returns the group's record."""
    if not members:
        raise ValueError("a group needs at least one member")
    group_id = f"g-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    daemons = _distinct([d for d, _ in members])

    def prepare(d: Daemon, pid: int) -> Callable[[], Any]:
        return lambda: d.stub.GroupPrepare(pb.GroupPrepareRequest(
            group_id=group_id, pid=pid, name=name, leave_running=leave_running,
            timeout_s=hold_s), timeout=d.timeout_s)

    started = time.monotonic()
    prepared = _each([prepare(d, pid) for d, pid in members])
    failed = [f"{d.address} pid {pid}: {_text(r)}"
              for (d, pid), r in zip(members, prepared, strict=True)
              if isinstance(r, BaseException)]
    failed += _too_slow(started, hold_s)
    if failed:
        _on_each(daemons, _abort(group_id))
        raise GroupError(f"group {group_id} not checkpointed (every member resumed)", failed)

    committed = _on_each(daemons, _commit(group_id))
    failed = [f"{d.address}: {_text(r)}" for d, r in zip(daemons, committed, strict=True)
              if isinstance(r, BaseException)]
    if failed:
        raise GroupError(f"group {group_id} not recorded (a member failed to commit)", failed)

    record = GroupRecord(
        id=group_id, name=name, created=time.time(),
        members=tuple(
            GroupMember(node=str(getattr(p, "node", "")), address=d.address,
                        checkpoint_id=str(getattr(p, "checkpoint_id", "")), pid=pid)
            for (d, pid), p in zip(members, prepared, strict=True)
        ),
    )
    wrote = _on_each(daemons, lambda d: d.stub.RecordGroup(convert.group(record),
                                                           timeout=d.timeout_s))
    failed = [f"{d.address}: {_text(r)}" for d, r in zip(daemons, wrote, strict=True)
              if isinstance(r, BaseException)]
    if len(failed) == len(daemons):
        raise GroupError(f"group {group_id} committed but recorded nowhere", failed)
    return record


def group_restore(
    group: GroupRecord, daemons: Sequence[Daemon], *, hold_s: float = 60.0
) -> dict[str, int]:
    """Restore every member of ``group`` (each on the daemon at its recorded address, among
    ``daemons``), all-or-nothing; returns checkpoint id -> restored root pid."""
    by_address = {d.address: d for d in daemons}
    missing = [m.address for m in group.members if m.address not in by_address]
    if missing:
        raise ValueError(f"no daemon given for member address(es) {', '.join(missing)}")
    restore_id = f"{group.id}-r{secrets.token_hex(3)}"
    members = [(by_address[m.address], m) for m in group.members]
    def prepare(d: Daemon, m: GroupMember) -> Callable[[], Any]:
        return lambda: d.stub.GroupPrepareRestore(pb.GroupPrepareRestoreRequest(
            group_id=restore_id, checkpoint_id=m.checkpoint_id, timeout_s=hold_s),
            timeout=d.timeout_s)

    started = time.monotonic()
    held = _each([prepare(d, m) for d, m in members])
    involved = _distinct([d for d, _ in members])
    failed = [f"{d.address} {m.checkpoint_id}: {_text(r)}"
              for (d, m), r in zip(members, held, strict=True) if isinstance(r, BaseException)]
    failed += _too_slow(started, hold_s)
    if failed:
        _on_each(involved, _abort(restore_id))
        raise GroupError(f"group {group.id} not restored (every restored member killed)",
                         failed)
    done = _on_each(involved, _commit(restore_id))
    failed = [f"{d.address}: {_text(r)}" for d, r in zip(involved, done, strict=True)
              if isinstance(r, BaseException)]
    if failed:
        raise GroupError(f"group {group.id}: a member failed to resume", failed)
    return {m.checkpoint_id: int(getattr(h, "pid", 0))
            for (_d, m), h in zip(members, held, strict=True)}
