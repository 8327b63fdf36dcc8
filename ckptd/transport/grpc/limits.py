"""Per-caller limits on the local API: calls in progress and operations running, by uid.

Every call of every service on the public socket (Checkpointer, health, reflection) passes
``LimitInterceptor``, which runs in the worker that serves the call: a caller's uid (from the
relay's peer path, ADR 0001) is admitted or refused at once with RESOURCE_EXHAUSTED; a call
is never queued behind another caller's. Dumps, restores and migrations also take an
operation slot (``CallLimits.operation``) for as long as their work runs, even after the
client has gone.

Invariants:

- a uid other than root holds at most ``per_uid`` calls and at most ``operations_per_uid``
  operations;
- a stream that may stay open as long as its client likes (``LONG_LIVED``: ``events
  --follow``, health Watch, reflection) takes no call slot but one of ``open_streams_per_uid``
  stream slots of its uid (issue 21: idle streams held every call slot of their users), all
  users' together at most ``shared_open_streams``: idle streams never block a unary call;
- callers other than root together hold at most ``shared`` calls, fewer than the server's
  ``max_workers``; the server has ``shared_open_streams`` more workers for open streams, so
  ``max_workers - shared`` workers are always free for root whatever users do;
- root is never refused here (its calls are bounded by the server's workers);
- a slot is released exactly once, when the call (or its operation) ends, however it ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ckptd.domain import Caller
from ckptd.errors import TooManyRequests
from ckptd.transport.grpc.peercred import caller_of
from ckptd.transport.grpc.status import abort_with


@dataclass(frozen=True)
class Limits:
    per_uid: int = 8
    """Calls in progress per uid (root: unlimited)."""
    operations_per_uid: int = 2
    """Dumps, restores and migrations running per uid (root: unlimited)."""
    shared: int = 12
    """Calls in progress of all uids but root together (keep it below ``max_workers``)."""
    open_streams_per_uid: int = 4
    """Long-lived streams (``LONG_LIVED``) open per uid (root: unlimited)."""
    shared_open_streams: int = 8
    """Long-lived streams of all uids but root together (the server has as many workers more
    than ``max_workers``)."""


LONG_LIVED = frozenset({
    "/ckptd.v1.Checkpointer/Watch",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})
"""Methods whose calls stay open as long as the client wants (nothing bounds their work):
they take a stream slot, not a call slot. Dumps, restores and migrations stream too, but end
with their operation (bounded by the operation slots)."""


class CallLimits:
    """The counts behind the limits; thread-safe."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._calls: Counter[int] = Counter()
        self._operations: Counter[int] = Counter()
        self._streams: Counter[int] = Counter()

    def calls(self) -> dict[int, int]:
        with self._lock:
            return dict(self._calls)

    def open_streams(self) -> dict[int, int]:
        with self._lock:
            return dict(self._streams)

    @contextlib.contextmanager
    def open_stream(self, caller: Caller) -> Iterator[None]:
        """Hold a long-lived stream slot of ``caller`` for the block (no call slot);
        TooManyRequests when over a limit."""
        uid = caller.uid
        with self._lock:
            if uid != 0:
                mine = self._streams[uid]
                if mine >= self.limits.open_streams_per_uid:
                    raise TooManyRequests(
                        f"too many open streams from uid {uid}: {mine} open "
                        f"(max_open_streams_per_uid {self.limits.open_streams_per_uid})",
                        hint="close one (an `events --follow`), then retry")
                users = sum(n for u, n in self._streams.items() if u != 0)
                if users >= self.limits.shared_open_streams:
                    raise TooManyRequests(
                        f"users hold {users} open streams already "
                        f"(max_user_open_streams {self.limits.shared_open_streams})",
                        hint="retry later")
            self._streams[uid] += 1
        try:
            yield
        finally:
            self._release(self._streams, uid)

    @contextlib.contextmanager
    def call(self, caller: Caller) -> Iterator[None]:
        """Hold a call slot of ``caller`` for the block; TooManyRequests when over a limit."""
        uid = caller.uid
        with self._lock:
            if uid != 0:
                mine = self._calls[uid]
                if mine >= self.limits.per_uid:
                    raise TooManyRequests(
                        f"too many calls from uid {uid}: {mine} in progress "
                        f"(max_calls_per_uid {self.limits.per_uid})")
                users = sum(n for u, n in self._calls.items() if u != 0)
                if users >= self.limits.shared:
                    raise TooManyRequests(
                        f"the daemon serves {users} calls of users already "
                        f"(max_user_calls {self.limits.shared})")
            self._calls[uid] += 1
        try:
            yield
        finally:
            self._release(self._calls, uid)

    @contextlib.contextmanager
    def operation(self, caller: Caller, what: str) -> Iterator[None]:
        """Hold an operation slot (a dump, restore, migration) of ``caller`` for the block."""
        uid = caller.uid
        with self._lock:
            mine = self._operations[uid]
            if uid != 0 and mine >= self.limits.operations_per_uid:
                raise TooManyRequests(
                    f"{what} refused: uid {uid} runs {mine} operations already "
                    f"(max_operations_per_uid {self.limits.operations_per_uid})",
                    hint="wait for one to finish (`ckptctl events`), then retry")
            self._operations[uid] += 1
        try:
            yield
        finally:
            self._release(self._operations, uid)

    def _release(self, counts: Counter[int], uid: int) -> None:
        with self._lock:
            counts[uid] -= 1
            if counts[uid] <= 0:
                del counts[uid]


class LimitInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Admits every call through ``CallLimits.call``, or ``CallLimits.open_stream`` for the
    methods of ``long_lived`` (see the module's invariants); a caller the relay did not
    identify is refused (PERMISSION_DENIED)."""

    def __init__(self, limits: CallLimits, peer_dir: Path,
                 long_lived: frozenset[str] = LONG_LIVED) -> None:
        self._limits = limits
        self._peer_dir = peer_dir
        self._long_lived = long_lived

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.response_streaming:
            inner = handler.unary_stream or handler.stream_stream
            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            behaviour: Callable[..., Any] = self._streaming(
                inner, handler_call_details.method in self._long_lived)
        else:
            inner = handler.unary_unary or handler.stream_unary
            make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                    else grpc.unary_unary_rpc_method_handler)
            behaviour = self._unary(inner)
        return make(behaviour, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        return caller_of(context, self._peer_dir)

    def _slot(self, context: grpc.ServicerContext, long_lived: bool = False
              ) -> contextlib.AbstractContextManager[None]:
        caller = self._caller(context)
        slot = (self._limits.open_stream(caller) if long_lived
                else self._limits.call(caller))
        try:
            slot.__enter__()
        except TooManyRequests as exc:
            abort_with(context, exc, "call")
        return slot

    def _unary(self, inner: Callable[[Any, grpc.ServicerContext], Any]
               ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            slot = self._slot(context)
            try:
                return inner(request, context)
            finally:
                slot.__exit__(None, None, None)
        return behaviour

    def _streaming(self, inner: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
                   long_lived: bool) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            slot = self._slot(context, long_lived)
            try:
                yield from inner(request, context)
            finally:  # also when the client goes away (the generator is closed)
                slot.__exit__(None, None, None)
        return behaviour
