"""What happened, as a stream: the daemon's operations publish events on an ``EventBus``;
the Watch RPC, ``ckptctl events`` and the Prometheus metrics read them.

Invariants: events get increasing ``seq`` numbers in publish order; publishing never blocks
nor fails the operation that publishes (a slow watcher loses its oldest events, and is told how
many); listeners run synchronously and their errors are logged, never raised; the last
``keep`` events stay readable for a watcher that connects later.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from ckptd.core.ports import Clock
from ckptd.domain import Event, EventKind

log = logging.getLogger(__name__)

Listener = Callable[[Event], None]


class Subscription:
    """Events published after it was opened (plus ``backlog`` earlier ones), in order."""

    def __init__(self, bus: EventBus, backlog: list[Event], limit: int) -> None:
        self._bus = bus
        self._items: collections.deque[Event] = collections.deque(backlog, maxlen=limit)
        self._cond = threading.Condition()
        self.dropped = 0
        self.closed = False

    def _push(self, event: Event) -> None:
        with self._cond:
            if len(self._items) == self._items.maxlen:
                self.dropped += 1
            self._items.append(event)
            self._cond.notify_all()

    def next(self, timeout: float) -> Event | None:
        """The next event, or None after ``timeout`` seconds (or once closed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self.closed, timeout=timeout)
            return self._items.popleft() if self._items else None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._bus._unsubscribe(self)


class EventBus:
    def __init__(self, clock: Clock, keep: int = 1000) -> None:
        self._clock = clock
        self._recent: collections.deque[Event] = collections.deque(maxlen=keep)
        self._subs: list[Subscription] = []
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._seq = 0

    def publish(
        self,
        kind: EventKind,
        *,
        pid: int = 0,
        checkpoint_id: str = "",
        name: str = "",
        message: str = "",
        uid: int = -1,
        **fields: Any,
    ) -> Event:
        with self._lock:
            self._seq += 1
            event = Event(
                seq=self._seq, time=self._clock.time(), kind=kind, pid=pid,
                checkpoint_id=checkpoint_id, name=name, message=message, uid=uid,
                fields={k: v for k, v in fields.items() if v is not None},
            )
            self._recent.append(event)
            subs = list(self._subs)
            listeners = list(self._listeners)
        for sub in subs:
            sub._push(event)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", event.kind)
        return event

    def recent(self, limit: int = 100) -> list[Event]:
        with self._lock:
            return list(self._recent)[-limit:] if limit > 0 else []

    def subscribe(self, backlog: int = 0, limit: int = 10_000) -> Subscription:
        with self._lock:
            sub = Subscription(self, list(self._recent)[-backlog:] if backlog else [], limit)
            self._subs.append(sub)
        return sub

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
