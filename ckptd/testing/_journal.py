"""``MemoryJournal``: a ``Journal`` in memory."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptd.core.ports import Journal


class MemoryJournal:
    """A ``Journal`` (see ``ckptd.core.ports``) kept in a dict.

    Behaviour, like ``FileJournal``: ``begin`` stores the facts as JSON (so facts that a file
    journal could not store raise ``TypeError`` here too, and later changes to the caller's
    dict are not seen); ``begin`` of an existing op id replaces its facts; ``end`` is
    idempotent; ``pending`` yields ``(op_id, facts)`` sorted by op id, from a snapshot (so
    ``end`` may be called while iterating).

    ``history`` records ``("begin" | "end", op_id)``; with ``events``, ``"journal.begin
    <id>"`` / ``"journal.end <id>"`` are appended too. ``fail_begin``, when set, is raised by
    ``begin``. Thread-safe.
    """

    def __init__(self, *, events: list[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, str] = {}
        self.events = events
        self.history: list[tuple[str, str]] = []
        self.fail_begin: Exception | None = None

    def begin(self, op_id: str, facts: dict[str, Any]) -> None:
        """Record ``op_id`` as in flight with ``facts``."""
        encoded = json.dumps(facts)
        with self._lock:
            if self.fail_begin is not None:
                raise self.fail_begin
            self._entries[op_id] = encoded
            self._note("begin", op_id)

    def end(self, op_id: str) -> None:
        """Forget ``op_id``. Idempotent."""
        with self._lock:
            self._entries.pop(op_id, None)
            self._note("end", op_id)

    def pending(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The operations in flight, by op id."""
        with self._lock:
            snapshot = sorted(self._entries.items())
        for op_id, encoded in snapshot:
            yield op_id, json.loads(encoded)

    def _note(self, what: str, op_id: str) -> None:
        self.history.append((what, op_id))
        if self.events is not None:
            self.events.append(f"journal.{what} {op_id}")


if TYPE_CHECKING:

    def _is_a_journal(journal: MemoryJournal) -> Journal:
        return journal
