"""The end of a lazy restore: the tree runs while its pages are still being served.

A lazy restore (``RestoreRequest.lazy``) returns once the tree runs; the CRIU adapter goes on
serving the tree's pages from the store (``CriuRestoreJob.lazy``) and tells ``LazyWatch``
how that ends, from its own thread:

- ``done``: every page served. The restore's journal entry ends, the store's checkout and the
  tree's handles are released, ``restore.lazy_done`` is published.
- ``failed``: a page could not be served (damaged, missing), or CRIU's page daemon ended
  first. The restored tree, with whatever it forked since, is SIGKILLed and waited for while
  the page it touched is still unanswered; ``restore.lazy_failed`` is published with the
  checkpoint, the pid and the reason. The tree never runs on with a page it did not get.

Invariants: nothing here acts before the recipe has finished (``recipe_ended``): a failure
the recipe rolled back itself (it killed the tree) ends the watch with nothing more to do.
Until ``done`` or ``failed`` the restore's journal entry stays open with a KillTree of the
tree and, last, of CRIU's page daemon (``helper``): a daemon that dies meanwhile has the next
start kill them (the tree is then waiting on a page: the page daemon keeps its end open), the
tree first, so no task can return from a fault after the page daemon is gone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ckptd.core.events import EventBus
from ckptd.core.held import HeldTree
from ckptd.core.ports import ProcessTable
from ckptd.core.rollback import Undoer
from ckptd.core.undo import UndoLog
from ckptd.domain import EventKind, PidState
from ckptd.errors import CkptdError

log = logging.getLogger(__name__)

KILL_WAIT_S = 10.0
"""How long a failed lazy restore waits for its killed tree to be dead."""


class LazyWatch:
    """``ports.LazyPages`` for one restore (see the module doc). Thread-safe."""

    def __init__(self, *, checkpoint_id: str, uid: int, processes: ProcessTable,
                 undoer: Undoer, events: EventBus | None) -> None:
        self.checkpoint_id = checkpoint_id
        self._uid = uid
        self._processes = processes
        self._undoer = undoer
        self._events = events
        self.helper: list[int] = []
        """``[pid, start time]`` of CRIU's page daemon (killed after the tree)."""
        self._ended = threading.Event()
        self._adopted = False
        self._lock = threading.Lock()
        self._resources = contextlib.ExitStack()
        self._held: HeldTree | None = None
        self._undo_log: UndoLog | None = None
        self._root = 0
        self._finished = False
        self._callbacks: list[Callable[[], None]] = []
        self.outcome: str = ""
        """"" while pages are served; then "done" or the failure."""

    # ---- the adapter's side (ports.LazyPages) -------------------------------------------

    def started(self, helper_pid: int) -> None:
        start = self._processes.status(helper_pid).start_time
        self.helper = [helper_pid, start]

    def failed(self, error: CkptdError) -> None:
        self._ended.wait()
        with self._lock:
            if not self._adopted:
                return  # the recipe failed: its rollback killed the tree
            held, root = self._held, self._root
            killed: list[int] = []
            if held is not None:  # (None: the root was gone at post-restore already)
                with contextlib.suppress(CkptdError):  # children forked since the restore
                    held.hold_facts(self._processes.tree(root))
                killed = self._undoer.kill_tree(held, wait_s=KILL_WAIT_S)
            self.outcome = str(error)
            self._publish(
                EventKind.RESTORE_LAZY_FAILED, pid=root, checkpoint_id=self.checkpoint_id,
                uid=self._uid, error=type(error).__name__,
                message=f"lazy restore of {self.checkpoint_id} failed: {error}; the restored "
                f"tree (pid {root}, {len(killed)} process(es)) was killed before it could "
                "run on a page it did not get",
            )
            log.error("lazy restore of %s failed: %s; pid %d and its tree killed",
                      self.checkpoint_id, error, root)
            self._finish()

    def done(self, pages: int, seconds: float) -> None:
        self._ended.wait()
        with self._lock:
            if not self._adopted:
                return
            self.outcome = "done"
            tree_ended = self._tree_ended()
            if tree_ended:  # CRIU's page daemon ends when its last task does
                message = (f"lazy restore of {self.checkpoint_id} ended with its tree: pid "
                           f"{self._root} and the processes restored with it exited "
                           f"{seconds:.2f}s after they began to run, {pages} page(s) served")
            else:
                message = (f"lazy restore of {self.checkpoint_id}: all {pages} page(s) in, "
                           f"{seconds:.2f}s after the tree began to run")
            self._publish(
                EventKind.RESTORE_LAZY_DONE, pid=self._root, checkpoint_id=self.checkpoint_id,
                uid=self._uid, pages=pages, seconds=round(seconds, 3),
                tree_ended=tree_ended, message=message,
            )
            self._finish()

    def _tree_ended(self) -> bool:
        """Every process restored (held since post-restore) has exited: the page daemon
        ended because nothing was left to serve, not because every page came in."""
        held = self._held
        return held is not None and all(
            held.state(pid) in (PidState.FREE, PidState.ZOMBIE) for pid in held.pids)

    # ---- the recipe's side --------------------------------------------------------------

    def adopt(self, resources: contextlib.ExitStack, held: HeldTree | None, root: int,
              undo_log: UndoLog | None) -> None:
        """The recipe succeeded (the tree runs): what it holds until the last page is served
        (the store's checkout, the tree's handles, its journal entry) is ours now."""
        with self._lock:
            self._resources.enter_context(resources)
            self._held, self._root, self._undo_log = held, root, undo_log
            self._adopted = True
        self._ended.set()

    def abandon(self) -> None:
        """The recipe failed and rolled back: nothing is left to watch."""
        self._ended.set()

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every page is in or the tree was killed (at once if that
        happened already)."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback()

    def _publish(self, kind: EventKind, **fields: Any) -> None:
        if self._events is not None:
            self._events.publish(kind, **fields)

    def _finish(self) -> None:
        """(under ``_lock``)"""
        if self._undo_log is not None:
            self._undo_log.end()
        if self._held is not None:
            self._held.close()
        self._resources.close()
        self._finished = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()
