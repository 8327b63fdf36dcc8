"""``CallWorker``: where the CUDA adapter's driver calls run — one lane per pid, calls on
different pids concurrently, each call's wait bounded from the moment it starts.

A lane is a thread serving the calls on one pid (or the calls on no pid: backend checks),
in submission order; it ends when it has nothing left to do and a later call starts a new
one (same name). Calls on different pids never wait for each other: the driver checkpoints
processes independently (NVIDIA's own integrations drive pids in parallel: CRIU's cuda
plugin runs one ``cuda-checkpoint`` per process of the tree from each CRIU, several CRIUs
at once on a node, and the driver API takes a pid per call — ``cuCheckpointProcessLock``
etc., CUDA Driver API "Checkpointing" group, r570+).

A driver call can hang (a target that never reaches a lockable point, a wedged driver). The
caller's wait is bounded: ``timeout_s`` counts from when the call *starts* in the driver,
not from its submission, so a call queued behind another on the same pid is not charged
the other's time. A call still queued when ``timeout_s`` has passed since its submission
never reaches the driver: it is dropped and fails saying what it was queued behind (code
``QUEUED``). A call that started and outlives its bound is *abandoned* (code ``TIMEOUT``):
its lane finishes it on its own (a daemon thread, so it never holds up the interpreter's
exit), keeping its eventual answer; then ``on_late`` runs on that lane (to settle the
process), the pid is released, and the lane goes on with what is queued. The abandoned call
cannot be cancelled (killing a thread mid-call could leave the driver out of sync).

Invariants: on one pid at most one call runs at a time, in submission order; calls on
different pids do not wait for each other; ``run`` never waits longer than ``timeout_s``
for the start plus ``timeout_s`` from the start (plus scheduling); while a call on a pid is
abandoned and still running, every later call on that pid is refused at once (``GpuFailed``
code ``BUSY``), so no second driver call ever races a stuck one on the same process;
``close`` waits at most ``CLOSE_WAIT_S`` in all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from ckptd.errors import GpuFailed, GpuUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for the calls in progress before leaving their threads behind."""


@dataclass
class _Item:
    work: Callable[[], Any]
    call: str
    pid: int | None = None
    future: Future[Any] = field(default_factory=Future)
    on_late: Callable[[], None] | None = None
    abandoned: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0


class _Lane:
    """The thread serving the calls on one pid (``None``: calls on no pid)."""

    def __init__(self, key: int | None, name: str, serve: Callable[[_Lane], None]) -> None:
        self.key = key
        self.items: deque[_Item] = deque()
        self.current: _Item | None = None
        self.thread = threading.Thread(target=serve, args=(self,), name=name, daemon=True)


class CallWorker:
    """Runs callables on per-pid lanes, each wait bounded (module doc)."""

    def __init__(self, name: str = "ckptd-cuda") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._lanes: dict[int | None, _Lane] = {}
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
        """``work()`` on ``pid``'s lane; its result or exception. A call not started within
        ``timeout_s`` of its submission is dropped (``GpuFailed`` code ``QUEUED``); one that
        runs past ``timeout_s`` from its start raises ``GpuFailed`` code ``TIMEOUT`` and is
        abandoned (module doc); ``on_late`` runs after it returns at last. None: no bound."""
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
            item = _Item(work, call, pid, on_late=on_late)
            lane = self._lanes.get(pid)
            if lane is None:
                lane = self._start_lane(pid)
            lane.items.append(item)
            ahead = lane.current or (lane.items[0] if len(lane.items) > 1 else None)
            submitted = time.monotonic()
        where = f" for pid {pid}" if pid is not None else ""
        try:
            if not item.started.wait(timeout_s) and self._drop(lane, item):
                self._queued(item, ahead, where, timeout_s, submitted)
            left = None if timeout_s is None else item.started_at + timeout_s - time.monotonic()
            bound = None if left is None else max(left, 0.0)
            return item.future.result(timeout=bound)  # type: ignore[no-any-return]
        except FutureTimeout:
            pass
        except CancelledError:
            raise GpuUnavailable(
                f"{call}{where} not made: the CUDA checkpointer closed (daemon stopping) "
                "while it was queued", pid=pid
            ) from None
        if not self._abandon(item, call):
            return item.future.result()  # type: ignore[no-any-return]
        message = (
            f"{call}{where} failed: no answer from the driver within {timeout_s:g}s of the "
            "call's start; the call was abandoned (its answer, when it comes, is settled "
            "and logged) and other calls go on"
        )
        log.error("%s", message)
        raise GpuFailed(message, call=call, code="TIMEOUT", pid=pid)

    def close(self) -> None:
        """Refuse later calls and drop the queued ones; wait for the calls in progress at
        most ``CLOSE_WAIT_S`` in all. Idempotent."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            for lane in lanes:
                while lane.items:
                    lane.items.popleft().future.cancel()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for lane in lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                log.warning("CUDA lane %s still in a driver call at close: left behind",
                            lane.thread.name)

    def busy(self) -> dict[int, str]:
        """pid -> the abandoned call still running on it."""
        with self._lock:
            return dict(self._busy)

    # ---- internals -----------------------------------------------------------------------

    def _start_lane(self, key: int | None) -> _Lane:
        """A new lane for ``key`` (under ``_lock``)."""
        lane = _Lane(key, f"{self._name}-{'any' if key is None else key}", self._serve)
        self._lanes[key] = lane
        lane.thread.start()
        return lane

    def _serve(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                item = None
                while lane.items:
                    candidate = lane.items.popleft()
                    if candidate.future.set_running_or_notify_cancel():
                        item = candidate
                        break
                if item is None:  # nothing left: the lane ends (a later call starts one)
                    if self._lanes.get(lane.key) is lane:
                        del self._lanes[lane.key]
                    lane.current = None
                    return
                lane.current = item
                item.started_at = time.monotonic()
                item.started.set()
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
            if abandoned:  # its caller gave up: settle the late answer, then free the pid
                self._released(item)
            with self._lock:
                lane.current = None

    def _drop(self, lane: _Lane, item: _Item) -> bool:
        """Drop ``item`` if it has not started (True); False: it started just now."""
        with self._lock:
            if item.started.is_set():
                return False
            if item in lane.items:
                lane.items.remove(item)
            item.future.cancel()
            return True

    def _queued(
        self, item: _Item, ahead: _Item | None, where: str, timeout_s: float | None,
        submitted: float,
    ) -> NoReturn:
        with self._lock:
            lane = self._lanes.get(item.pid)
            now = lane.current if lane is not None else None
        blocker = now or ahead
        if blocker is not None:
            running = (f", running for {time.monotonic() - blocker.started_at:.0f}s"
                       if blocker.started.is_set() else "")
            behind = f"queued behind {blocker.call}{where}{running}"
        else:
            behind = "queued"
        waited = time.monotonic() - submitted
        message = (
            f"{item.call}{where} not made: {behind} for {waited:.0f}s (its bound "
            f"{timeout_s:g}s); it never reached the driver"
        )
        log.error("%s", message)
        raise GpuFailed(message, call=item.call, code="QUEUED", pid=item.pid,
                        hint="the driver is still busy with the earlier call on this "
                        "process; retry once it returns (the daemon logs it)")

    def _abandon(self, item: _Item, call: str) -> bool:
        """Abandon ``item``, which started (False: it finished just now, nothing
        abandoned)."""
        with self._lock:
            if item.future.done():
                return False
            item.abandoned = True
            if item.pid is not None:
                self._busy[item.pid] = call
        return True

    def _released(self, item: _Item) -> None:
        """On the lane, once its abandoned call returned: run ``on_late``, free the pid."""
        error = item.future.exception()
        outcome = f"failed ({error})" if error is not None else "succeeded"
        log.warning("abandoned CUDA call %s for pid %s %s at last; settling it", item.call,
                    item.pid, outcome)
        try:
            if item.on_late is not None:
                item.on_late()
        except Exception:
            log.exception("settling the abandoned CUDA call %s for pid %s", item.call,
                          item.pid)
        finally:
            with self._lock:
                if item.pid is not None:
                    self._busy.pop(item.pid, None)
