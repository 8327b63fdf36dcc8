"""The Checkpointer gRPC service: a few lines per RPC (protobuf -> domain -> core -> protobuf).

Errors from the core end the call with the code ``status.code_for`` picks and a one-line
message. A client that goes away mid-Dump does not abort the dump: stopping half-way is what
could hurt the target, finishing is safe.

Every request is checked against the edge's rules (``ckptd.transport.validate``, through
``convert``) before the core sees it: a bad field ends the call with INVALID_ARGUMENT naming
it. Dumps, restores and migrations hold one of the caller's operation slots
(``limits.CallLimits``) while their work runs; calls in general are admitted by
``limits.LimitInterceptor`` before they reach this class.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ckptd import __version__
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc as pb_grpc
from ckptd.core.groups import GroupMembers
from ckptd.core.migrate import MigrateRecipe
from ckptd.core.policies import PolicyService
from ckptd.core.service import CheckpointService
from ckptd.domain import Caller, Event, Progress
from ckptd.transport import validate as v
from ckptd.transport.grpc import convert
from ckptd.transport.grpc.group_rpcs import GroupRpcs
from ckptd.transport.grpc.limits import CallLimits, Limits
from ckptd.transport.grpc.peercred import caller_of
from ckptd.transport.grpc.status import abort_with

T = TypeVar("T")
log = logging.getLogger("ckptd.transport.grpc")

_DONE = object()


class CheckpointerServicer(GroupRpcs, pb_grpc.CheckpointerServicer):
    def __init__(
        self,
        service: CheckpointService,
        peer_dir: Path,
        migrate: MigrateRecipe | None = None,
        policies: PolicyService | None = None,
        groups: GroupMembers | None = None,
        node: str = "",
        limits: CallLimits | None = None,
        after_operation: Callable[[], None] | None = None,
    ) -> None:
        """``after_operation``: called once each dump, restore or migration has ended (the
        daemon gives back the memory it freed)."""
        self._after_operation = after_operation
        self._limits = limits or CallLimits(Limits())
        self._groups = groups
        self._node = node
        self._service = service
        self._peer_dir = peer_dir
        self._migrate = migrate
        self._policies = policies

    # ---- helpers ----------------------------------------------------------------------------

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        return caller_of(context, self._peer_dir)

    def _unary(self, context: grpc.ServicerContext, fn: Callable[[Caller], T]) -> T:
        caller = self._caller(context)
        try:
            return fn(caller)
        except Exception as exc:
            self._fail(context, exc)
            raise  # unreachable: abort raises

    @staticmethod
    def _fail(context: grpc.ServicerContext, exc: BaseException) -> None:
        abort_with(context, exc, "request")

    def _ended(self) -> None:
        """An operation ended: ``after_operation``, whose failure is only logged."""
        if self._after_operation is None:
            return
        try:
            self._after_operation()
        except Exception:
            log.exception("after an operation")

    def _checked(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """``fn()`` (a request's conversion and checks), its error ending the call."""
        try:
            return fn()
        except Exception as exc:
            self._fail(context, exc)
            raise  # unreachable: abort raises

    def _stream(
        self,
        context: grpc.ServicerContext,
        what: str,
        run: Callable[[Caller, Callable[[Progress], None]], T],
        wrap_progress: Callable[[pb.Progress], Any],
        wrap_result: Callable[[T], Any],
    ) -> Iterator[Any]:
        """Run ``run`` in a thread of its own, holding one of the caller's operation slots
        until it ends (the client may go away first); stream its progress, then its result
        or its error."""
        caller = self._caller(context)
        slot = self._checked(context, lambda: self._limits.operation(caller, what))
        self._checked(context, slot.__enter__)
        events: queue.Queue[Any] = queue.Queue()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["result"] = run(caller, events.put)
            except Exception as exc:
                outcome["error"] = exc
            finally:
                slot.__exit__(None, None, None)
                self._ended()
                events.put(_DONE)

        try:
            threading.Thread(target=work, name="rpc-worker", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: the slot is the caller's again
            slot.__exit__(None, None, None)
            self._fail(context, exc)
        while True:
            item = events.get()
            if item is _DONE:
                break
            if context.is_active():
                yield wrap_progress(convert.progress(item))
        if "error" in outcome:
            self._fail(context, outcome["error"])
        yield wrap_result(outcome["result"])

    # ---- RPCs -----------------------------------------------------------------------------

    def Dump(self, request: pb.DumpRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        req = self._checked(context, lambda: convert.dump_request(request))
        return self._stream(
            context, f"dump of pid {req.pid}" if req.pid else f"dump of cgroup {req.cgroup}",
            lambda caller, sink: self._service.dump(caller, req, sink),
            lambda p: pb.DumpEvent(progress=p),
            lambda r: pb.DumpEvent(checkpoint=convert.checkpoint(r)),
        )

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        req = self._checked(context, lambda: convert.restore_request(request))
        return self._stream(
            context, "restore",
            lambda caller, sink: self._service.restore(caller, req, sink),
            lambda p: pb.RestoreEvent(progress=p),
            lambda o: pb.RestoreEvent(result=convert.restore_result(o)),
        )

    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        req = self._checked(context, lambda: convert.migrate_request(request))
        migrate = self._migrate
        if migrate is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon cannot migrate")
        assert migrate is not None
        service = self._service

        def run(caller: Caller, sink: Callable[[Progress], None]) -> Any:
            with service.operation(f"m{secrets.token_hex(4)}"):
                return migrate.run(caller, req, sink)

        return self._stream(
            context, f"migration of pid {req.pid}",
            run,
            lambda p: pb.MigrateEvent(progress=p),
            lambda o: pb.MigrateEvent(result=convert.migrate_result(o)),
        )

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        caller = self._caller(context)
        kinds = self._checked(context, lambda: v.kinds(request.kinds))
        backlog = self._checked(context, lambda: v.backlog(request.backlog))

        def wanted(e: Event) -> bool:
            if not caller.is_root and e.uid not in (caller.uid, -1):
                return False  # other users' jobs are none of the caller's business
            kind = e.kind.value
            return not kinds or any(kind == k or kind.startswith(f"{k}.") for k in kinds)

        bus = self._service.events
        if not request.follow:
            for e in bus.recent(backlog or 100):
                if wanted(e):
                    yield convert.event(e)
            return
        sub = bus.subscribe(backlog=backlog)
        context.add_callback(sub.close)
        try:
            while context.is_active() and not sub.closed:
                item = sub.next(0.5)
                if item is not None and wanted(item):
                    yield convert.event(item)
        finally:
            sub.close()

    def _policy_service(self, context: grpc.ServicerContext) -> PolicyService:
        if self._policies is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon has no policies")
        assert self._policies is not None
        return self._policies

    def SetPolicy(self, request: pb.SetPolicyRequest, context: grpc.ServicerContext) -> Any:
        policies = self._policy_service(context)
        policy = self._checked(context, lambda: convert.policy_from(request.policy))
        p = self._unary(context, lambda c: policies.set(
            c, policy, callers_child=request.callers_child))
        return convert.policy(p)

    def ListAsides(self, request: pb.ListAsidesRequest, context: grpc.ServicerContext) -> Any:
        checkpoint_id = self._checked(
            context, lambda: v.checkpoint_id(request.checkpoint_id, required=False))
        found = self._unary(context, lambda c: self._service.asides(c, checkpoint_id))
        return pb.ListAsidesResponse(asides=[convert.aside(r) for r in found])

    def ListPolicies(self, request: pb.ListPoliciesRequest, context: grpc.ServicerContext
                     ) -> Any:
        policies = self._policy_service(context)
        found = self._unary(context, policies.list)
        return pb.ListPoliciesResponse(policies=[convert.policy(p) for p in found])

    def ClearPolicy(self, request: pb.ClearPolicyRequest, context: grpc.ServicerContext) -> Any:
        policies = self._policy_service(context)
        name = self._checked(context, lambda: v.name(request.name, "job name", required=True))
        if request.unless_died_checkpointed:
            drained, kept = self._unary(
                context, lambda c: policies.clear_ended(c, name, died=True))
            return pb.ClearPolicyResponse(name=request.name, drained_checkpoint_id=drained,
                                          kept_checkpoint_id=kept)
        drained = self._unary(
            context, lambda c: policies.clear(c, name, unless_drained=request.unless_drained))
        return pb.ClearPolicyResponse(name=request.name, drained_checkpoint_id=drained)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> Any:
        policies = self._policy_service(context)
        names = self._checked(context, lambda: v.names(request.names, "job name"))
        drained, errors = self._unary(context, lambda c: policies.drain(c, names))
        return pb.DrainResponse(drained=[convert.policy(p) for p in drained], errors=errors)

    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> Any:
        policies = self._policy_service(context)
        name = self._checked(context, lambda: v.name(request.name, "job name"))
        done, errors = self._unary(context, lambda c: policies.resume(c, name))
        return pb.ResumeResponse(
            restored=[convert.restore_result(o) for o in done], errors=errors
        )

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        pid = self._checked(context, lambda: v.pid(request.pid, required=False))
        name = self._checked(context, lambda: v.name(request.name))
        records = self._unary(context, lambda c: self._service.list(c, pid=pid, name=name))
        return pb.ListResponse(checkpoints=[convert.checkpoint(r) for r in records])

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.Checkpoint:
        ck = self._checked(context, lambda: v.checkpoint_id(request.id))
        record = self._unary(context, lambda c: self._service.get(c, ck))
        return convert.checkpoint(record)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> Any:
        ck = self._checked(context, lambda: v.checkpoint_id(request.id))
        self._unary(context, lambda c: self._service.delete(c, ck))
        return pb.DeleteResponse(id=request.id)

    def ReservePids(self, request: pb.ReservePidsRequest, context: grpc.ServicerContext
                    ) -> Any:
        above = self._checked(context, lambda: v.pid(request.above, "pid", required=False))
        last = self._unary(context, lambda c: self._service.reserve_pids(c, above or 1000))
        return pb.ReservePidsResponse(last_pid=last)

    def Check(self, request: pb.CheckRequest, context: grpc.ServicerContext) -> Any:
        report = self._unary(context, lambda _c: self._service.check())
        return convert.check_response(report, __version__)

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> Any:
        ck = self._checked(context, lambda: v.checkpoint_id(request.id, required=False))
        report = self._unary(context, lambda c: self._service.verify(c, ck))
        return convert.verify_response(report)

    def CheckRestore(self, request: pb.CheckRestoreRequest, context: grpc.ServicerContext) -> Any:
        ck = self._checked(context, lambda: v.checkpoint_id(request.id))
        report = self._unary(context, lambda c: self._service.check_restore(c, ck))
        return convert.check_restore_response(report)

    def Gc(self, request: pb.GcRequest, context: grpc.ServicerContext) -> Any:
        keep = self._checked(context, lambda: v.count(request.keep_last, "keep-last"))
        name = self._checked(context, lambda: v.name(request.name))
        compact = not request.no_compact
        report = self._unary(
            context, lambda c: self._service.gc(c, keep_last=keep, name=name, compact=compact)
        )
        return convert.gc_response(report)
