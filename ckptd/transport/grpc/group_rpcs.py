"""The group checkpoint RPCs, served alike on the local API (callers by SO_PEERCRED) and on
the peer listener (callers by certificate, acting as root). A servicer using this mixin
provides ``_groups``, ``_node`` and ``_unary(context, fn)`` (``fn`` gets the caller)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.core.groups import GroupMembers
from ckptd.domain import Caller, CheckpointRecord, DumpRequest, GroupRecord, RestoreOutcome
from ckptd.errors import BadRequest, PermissionDenied
from ckptd.transport import validate as v
from ckptd.transport.grpc import convert

T = TypeVar("T")


class GroupRpcs:
    _groups: GroupMembers | None
    _node: str

    def _unary(self, context: grpc.ServicerContext, fn: Callable[[Caller], T]) -> T:
        raise NotImplementedError

    def _group_members(self, context: grpc.ServicerContext) -> GroupMembers:
        if self._groups is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon has no group support")
        assert self._groups is not None
        return self._groups

    def GroupPrepare(self, request: pb.GroupPrepareRequest, context: grpc.ServicerContext
                     ) -> Any:
        groups = self._group_members(context)

        def prepare(caller: Caller) -> str:
            group_id = v.group_id(request.group_id)
            # the peers of the member's TCP connections are the other members, dumped with it
            dump = DumpRequest(pid=v.pid(request.pid), leave_running=request.leave_running,
                               name=v.name(request.name), labels={"group": group_id},
                               tcp_peers_dumped=True)
            return groups.prepare(caller, group_id, dump, _timeout(request.timeout_s))

        ck = self._unary(context, prepare)
        return pb.GroupPrepareResponse(checkpoint_id=ck, node=self._node)

    def GroupCommit(self, request: pb.GroupCommitRequest, context: grpc.ServicerContext
                    ) -> Any:
        groups = self._group_members(context)
        results = self._unary(context, lambda c: groups.commit(c, v.group_id(request.group_id)))
        return pb.GroupCommitResponse(
            checkpoints=[convert.checkpoint(r) for r in results
                         if isinstance(r, CheckpointRecord)],
            restored=[convert.restore_result(r) for r in results
                      if isinstance(r, RestoreOutcome)],
        )

    def GroupPrepareRestore(self, request: pb.GroupPrepareRestoreRequest,
                            context: grpc.ServicerContext) -> Any:
        groups = self._group_members(context)
        pid = self._unary(context, lambda c: groups.prepare_restore(
            c, v.group_id(request.group_id), v.checkpoint_id(request.checkpoint_id),
            _timeout(request.timeout_s)))
        return pb.GroupPrepareRestoreResponse(pid=pid, node=self._node)

    def GroupAbort(self, request: pb.GroupAbortRequest, context: grpc.ServicerContext) -> Any:
        groups = self._group_members(context)
        return pb.GroupAbortResponse(
            resumed=self._unary(context, lambda c: groups.abort(c, v.group_id(request.group_id))))

    def RecordGroup(self, request: pb.Group, context: grpc.ServicerContext) -> Any:
        groups = self._group_members(context)

        def record(caller: Caller) -> None:
            group = _checked_group(request)
            if not groups.owned_by(group, caller):
                raise PermissionDenied(
                    f"group {group.id} names checkpoints here that are not the caller's"
                )
            groups.record(group)

        self._unary(context, record)
        return request

    def ListGroups(self, request: pb.ListGroupsRequest, context: grpc.ServicerContext) -> Any:
        groups = self._group_members(context)
        found = self._unary(context, lambda c: [g for g in groups.list_groups()
                                                if groups.owned_by(g, c)])
        return pb.ListGroupsResponse(groups=[convert.group(g) for g in found])


def _checked_group(msg: pb.Group) -> GroupRecord:
    """A group record from a caller, held to the edge's rules: its id a name, every member
    a checkpoint id (and a pid when given)."""
    group_id = v.group_id(msg.id)
    v.name(msg.name, "group name")
    if not msg.members:
        raise BadRequest(f"group {group_id} has no member; a group record names every "
                         "member's checkpoint", field="members", hint="")
    for m in msg.members:
        v.checkpoint_id(m.checkpoint_id, "group member checkpoint id")
        v.pid(m.pid, "group member pid", required=False)
    return convert.group_from(msg)


def _timeout(seconds: float) -> float:
    """A group member's wait for the decision: 60 s when not given, at most an hour."""
    return v.duration(seconds, "group timeout", maximum=3600.0) or 60.0
