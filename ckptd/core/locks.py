"""At most one operation per process at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckptd.errors import Busy


class PidLocks:
    """Non-blocking per-pid locks: a second holder is refused with Busy, never queued."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[int, str] = {}

    @contextmanager
    def hold(self, pid: int, what: str) -> Iterator[None]:
        with self._mutex:
            if pid in self._held:
                raise Busy(f"pid {pid} is busy: {self._held[pid]} is in progress", pid=pid)
            self._held[pid] = what
        try:
            yield
        finally:
            with self._mutex:
                del self._held[pid]
