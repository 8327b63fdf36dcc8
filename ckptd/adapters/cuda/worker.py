"""``CallWorker``: where the CUDA adapter's driver calls run — one at a time, each waited for
no longer than its bound.

A driver call can hang (a target that never reaches a lockable point, a wedged driver). The
caller's wait is bounded; past it the call is *abandoned*: its thread is left to finish the
call on its own (it is a daemon thread, so it never holds up the interpreter's exit), calls
queued behind it move to a fresh thread, and the daemon goes on serving. The abandoned call
cannot be cancelled (killing a thread mid-call could leave the driver out of sync); when it
returns at last, its ``on_late`` hook runs on that same thread, and the pid is released.

Invariants: at most one call runs on the current thread at a time, in submission order;
``run`` never waits longer than ``timeout_s`` (plus scheduling); while a call on a pid is
abandoned and still running, every later call on that pid is refused at once (``GpuFailed``
code ``BUSY``), so no second driver call ever races a stuck one on the same process;
``close`` waits at most ``CLOSE_WAIT_S``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptd.errors import GpuFailed, GpuUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for the call in progress before leaving its thread behind."""


@dataclass
class _Item:
    work: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    on_late: Callable[[], None] | None = None
    abandoned: bool = False
    pid: int | None = None


class _Thread:
    """One worker thread and its queue (``None`` in the queue: stop)."""

    def __init__(
        self, name: str, release: Callable[[_Item], None], lock: threading.Lock
    ) -> None:
        self.queue: queue.Queue[_Item | None] = queue.Queue()
        self._release = release
        self._lock = lock
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if not item.future.set_running_or_notify_cancel():
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = item.work()
            except BaseException as exc:
                error = exc
            with self._lock:  # the outcome and the abandoned flag, atomically
                if error is None:
                    item.future.set_result(result)
                else:
                    item.future.set_exception(error)
                abandoned = item.abandoned
            if abandoned:  # its caller gave up; this thread is no longer the worker
                self._release(item)
                return


class CallWorker:
    """Runs callables one at a time on a worker thread, each wait bounded (module doc)."""

    def __init__(self, name: str = "ckptd-cuda") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._generation = 0
        self._thread = self._new_thread()
        self._busy: dict[int, str] = {}
        """pid -> the abandoned call still running on it."""
        self._closed = False

    def run(
        self,
        work: Callable[[], T],
        timeout_s: float | None,
        *,
        call: str,
        pid: int | None = None,
        on_late: Callable[[], None] | None = None,
    ) -> T:
        """``work()`` on the worker thread; its result or exception. Past ``timeout_s``
        (None: no bound) raises ``GpuFailed`` code ``TIMEOUT`` and abandons the call (module
        doc); ``on_late`` runs after it returns at last."""
        with self._lock:
            if self._closed:
                raise GpuUnavailable(
                    "the CUDA checkpointer is closed (daemon stopping)", pid=pid
                )
            if pid is not None and pid in self._busy:
                raise GpuFailed(
                    f"{call} for pid {pid} refused: an earlier {self._busy[pid]} on it is "
                    "still running in the driver (abandoned after its time limit)",
                    call=call,
                    code="BUSY",
                    hint="retry once it returns (the daemon logs it); if it never does, the "
                    "process's CUDA state is stuck in the driver",
                    pid=pid,
                )
            item = _Item(work, on_late=on_late, pid=pid)
            worker = self._thread
            worker.queue.put(item)
        try:
            return item.future.result(timeout=timeout_s)  # type: ignore[no-any-return]
        except FutureTimeout:
            pass
        if not self._abandon(worker, item, call):
            return item.future.result()  # type: ignore[no-any-return]
        where = f" for pid {pid}" if pid is not None else ""
        message = (
            f"{call}{where} failed: no answer from the driver within {timeout_s:g}s; the call "
            "was abandoned (it may still complete) and later calls go to a new worker"
        )
        log.error("%s", message)
        raise GpuFailed(message, call=call, code="TIMEOUT", pid=pid)

    def close(self) -> None:
        """Refuse later calls, stop the worker after its call in progress, waiting at most
        ``CLOSE_WAIT_S``. Idempotent."""
        with self._lock:
            self._closed = True
            worker = self._thread
        worker.queue.put(None)
        worker.thread.join(CLOSE_WAIT_S)
        if worker.thread.is_alive():
            log.warning("CUDA worker still in a driver call at close: left behind")

    def busy(self) -> dict[int, str]:
        """pid -> the abandoned call still running on it."""
        with self._lock:
            return dict(self._busy)

    # ---- internals -----------------------------------------------------------------------

    def _new_thread(self) -> _Thread:
        self._generation += 1
        return _Thread(f"{self._name}-{self._generation}", self._released, self._lock)

    def _abandon(self, worker: _Thread, item: _Item, call: str) -> bool:
        """Abandon ``item`` (False: it finished just now, nothing abandoned)."""
        with self._lock:
            if item.future.done():
                return False
            if item.future.cancel():  # still queued behind another call: dropped, never run
                return True
            item.abandoned = True
            if item.pid is not None:
                self._busy[item.pid] = call
            if self._thread is worker:
                fresh = self._new_thread()
                self._thread = fresh
                while True:  # calls queued behind the stuck one go to the fresh thread
                    try:
                        pending = worker.queue.get_nowait()
                    except queue.Empty:
                        break
                    if pending is not None:
                        fresh.queue.put(pending)
                if self._closed:
                    fresh.queue.put(None)
        return True

    def _released(self, item: _Item) -> None:
        """On the abandoned thread, once its call returned: run ``on_late``, free the pid."""
        outcome = "failed" if item.future.exception() is not None else "succeeded"
        log.warning("abandoned CUDA call for pid %s %s at last", item.pid, outcome)
        try:
            if item.on_late is not None:
                item.on_late()
        except Exception:
            log.exception("after the abandoned CUDA call for pid %s", item.pid)
        finally:
            with self._lock:
                if item.pid is not None:
                    self._busy.pop(item.pid, None)
