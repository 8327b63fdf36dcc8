"""Settling a migration in doubt: the link broke while the target was restoring the tree.

The source (``MigrateRecipe`` in-process, or a restarted daemon from its journal's ``InDoubt``
entry, ``CheckpointService.unsettled``) asks the target what it did with the checkpoint
(``PeerLink.received``), again and again with a growing pause (``BACKOFF_S`` doubled up to
``BACKOFF_MAX_S``) while the target cannot be reached or says it is still restoring, for at
most ``within_s``. The target answers from its durable records (``core.receive``):

    restored        the job runs there: nothing is restored here
    not restored    it never committed a restore, and never will (the answer fences it
                    there first): the job is restored here from the checkpoint kept here

Either way the source's journal entry ends and an event ``migrate.settled`` says which side runs
the job (``restored_on``: "target", "source", or "neither" when the restore here failed too:
the checkpoint stays). Without an answer in time the entry stays: the next start asks again;
an entry older than ``SETTLE_MAX_AGE_S`` is not asked about any more (the target forgets its
records after ``service.RECEIVED_KEEP_S``): it is left to the operator, as the log says.

Invariants: nothing is restored here before the target said "not restored", and that answer is
a durable fence there, so the job never runs on both nodes; the checkpoint stays in this
node's store whatever the outcome.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ckptd.core.events import EventBus
from ckptd.core.ports import Clock, Journal, PeerConnector
from ckptd.core.rollback import BackHere, RestoreHereFn
from ckptd.core.undo import InDoubt, RestoreHere
from ckptd.domain import Caller, EventKind, ReceivedState, RestoreOutcome
from ckptd.errors import CkptdError, PeerError

log = logging.getLogger(__name__)

BACKOFF_S = 0.5
"""The first pause between two questions; doubled after each, up to ``BACKOFF_MAX_S``."""
BACKOFF_MAX_S = 10.0
SETTLE_WITHIN_S = 300.0
"""How long one settlement asks (a target daemon restarted by systemd answers well within)."""
SETTLE_MAX_AGE_S = 7 * 86400.0
"""An in-doubt entry older than this is left to the operator (targets keep their records for
30 days: ``service.RECEIVED_KEEP_S``)."""


@dataclass(frozen=True)
class Settled:
    """How one settlement ended: ``restored_on`` "target", "source", "neither" (both
    declined: the restore here failed), or "" (no answer: still in doubt)."""

    restored_on: str
    note: str
    state: ReceivedState | None = None
    here: RestoreOutcome | None = None


class Settler:
    def __init__(
        self,
        *,
        connector: PeerConnector,
        restore_here: RestoreHereFn | None,
        clock: Clock,
        journal: Journal | None = None,
        events: EventBus | None = None,
        within_s: float = SETTLE_WITHIN_S,
    ) -> None:
        self._connector = connector
        self._back_here = BackHere(restore_here)
        self._clock = clock
        self._journal = journal
        self._events = events
        self.within_s = within_s
        self._threads: list[threading.Thread] = []

    def ask(self, undo: InDoubt) -> ReceivedState | None:
        """The target's answer (restored, or not), asked until it gives one or ``within_s``
        passed (None then). A target that refuses the question (an older daemon) is not
        asked again."""
        deadline = self._clock.monotonic() + self.within_s
        pause = BACKOFF_S
        while True:
            try:
                link = self._connector.connect(undo.to)
                try:
                    state = link.received(undo.checkpoint_id)
                finally:
                    link.close()
                if not state.restoring:
                    return state
                why = f"{state.node or undo.to} is still restoring it"
            except PeerError as exc:
                why = exc.message
            except CkptdError as exc:
                log.error("migration of %s: %s cannot say whether it restored it: %s",
                          undo.checkpoint_id, undo.to, exc)
                return None
            left = deadline - self._clock.monotonic()
            if left <= 0:
                log.warning("migration of %s: no answer from %s within %.0fs (%s)",
                            undo.checkpoint_id, undo.to, self.within_s, why)
                return None
            log.info("migration of %s in doubt: %s; asking again in %.1fs",
                     undo.checkpoint_id, why, min(pause, left))
            self._clock.sleep(min(pause, left))
            pause = min(pause * 2, BACKOFF_MAX_S)

    def settle(self, op_id: str, undo: InDoubt, caller: Caller | None = None) -> Settled:
        """Ask ``undo.to``, then act on the answer (see the module docstring); the journal
        entry ``op_id`` ends unless there was no answer. ``caller``: who asked for the
        migration (in-process), else the entry's uid."""
        if undo.since and self._clock.time() - undo.since > SETTLE_MAX_AGE_S:
            note = (f"in doubt since {undo.since:.0f}, too long ago to ask {undo.to}: "
                    + BackHere.in_doubt(undo, "the link broke"))
            log.error("migration of %s: %s", undo.checkpoint_id, note)
            return Settled("", note)
        state = self.ask(undo)
        if state is None:
            return Settled("", f"{undo.to} did not answer within {self.within_s:.0f}s whether "
                           "it restored it: the checkpoint is kept, and the next start of this "
                           "daemon asks again")
        if state.restored:
            settled = Settled("target", f"{state.node or undo.to} restored it as pid "
                              f"{state.pid}", state)
        else:
            here, note = self._back_here.restore(
                RestoreHere(undo.checkpoint_id, undo.uid, undo.to), caller)
            settled = Settled("source" if here is not None else "neither",
                              f"{state.node or undo.to} never restored it; {note}", state, here)
        if self._journal is not None:
            self._journal.end(op_id)
        publish(self._events, undo, settled)
        return settled

    def settle_later(self, unsettled: Sequence[tuple[str, InDoubt]]) -> None:
        """``settle`` each, one thread each (a start does not wait for the targets)."""
        for op_id, undo in unsettled:
            thread = threading.Thread(target=self._settle_logged, args=(op_id, undo),
                                      name=f"settle-{undo.checkpoint_id}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the ``settle_later`` threads; True when none is left running."""
        for thread in list(self._threads):
            thread.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def _settle_logged(self, op_id: str, undo: InDoubt) -> None:
        try:
            settled = self.settle(op_id, undo)
        except Exception:
            log.exception("settling the migration of %s failed (its entry is kept)",
                          undo.checkpoint_id)
            return
        log.warning("migration of %s to %s settled: %s", undo.checkpoint_id, undo.to,
                    settled.note)


def publish(events: EventBus | None, undo: InDoubt, settled: Settled) -> None:
    """The ``migrate.settled`` event of ``settled`` (nothing while still in doubt)."""
    if events is None or not settled.restored_on:
        return
    pid = (settled.here.pid if settled.here is not None
           else settled.state.pid if settled.state is not None else 0)
    events.publish(
        EventKind.MIGRATE_SETTLED, pid=pid, uid=undo.uid, checkpoint_id=undo.checkpoint_id,
        message=f"the link to {undo.to} broke while it restored: {settled.note}",
        to=undo.to, restored_on=settled.restored_on,
        node=settled.state.node if settled.state is not None else "",
    )
