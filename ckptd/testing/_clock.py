"""``FakeClock``: a ``Clock`` whose time moves only when told to."""

from __future__ import annotations

import threading
from collections.abc import Callable

SleepListener = Callable[[float], None]


class FakeClock:
    """A ``Clock`` (see ``ckptd.core.ports``) for tests.

    Behaviour:

    - ``time()`` starts at ``start`` (wall clock, seconds since the epoch) and ``monotonic()``
      at ``monotonic_start``; both move together and only through ``advance`` or ``sleep``;
    - ``sleep(s)`` returns at once after advancing both clocks by ``s``; every call is kept
      in ``sleeps`` and then every listener registered with ``on_sleep`` is called with ``s``
      (this is how ``FakeProcessTable.reap_after`` makes a zombie go away "while" a restore
      waits for it);
    - a negative duration raises ``ValueError``, like ``time.sleep``.

    Thread-safe.
    """

    def __init__(self, start: float = 1_700_000_000.0, monotonic_start: float = 1_000.0) -> None:
        self._lock = threading.Lock()
        self._time = start
        self._monotonic = monotonic_start
        self._listeners: list[SleepListener] = []
        self.sleeps: list[float] = []
        """Every duration ``sleep`` was called with, in order."""

    def time(self) -> float:
        """The fake wall-clock time."""
        with self._lock:
            return self._time

    def monotonic(self) -> float:
        """The fake monotonic time."""
        with self._lock:
            return self._monotonic

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds`` (>= 0) without counting as a sleep."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards ({seconds}s)")
        with self._lock:
            self._time += seconds
            self._monotonic += seconds

    def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` at once, record the sleep and notify the listeners."""
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        self.advance(seconds)
        with self._lock:
            self.sleeps.append(seconds)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(seconds)

    def on_sleep(self, listener: SleepListener) -> Callable[[], None]:
        """Call ``listener(seconds)`` after every future ``sleep``; returns a function that
        removes it (safe to call more than once, also from inside the listener)."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove
