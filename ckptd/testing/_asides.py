"""``FakeAsideLog``: the ``AsideLog`` port in memory."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptd.core.ports.asides import AsideRecord

if TYPE_CHECKING:
    from ckptd.core.ports.asides import AsideLog


class FakeAsideLog:
    """Records kept in a list; ``fail_add`` makes ``add`` raise it (a full state dir)."""

    def __init__(self) -> None:
        self.kept: list[AsideRecord] = []
        self.fail_add: OSError | None = None
        self._lock = threading.Lock()

    def add(self, records: Sequence[AsideRecord]) -> None:
        if self.fail_add is not None:
            raise self.fail_add
        with self._lock:
            self.kept.extend(records)

    def records(self) -> tuple[AsideRecord, ...]:
        with self._lock:
            return tuple(sorted(self.kept, key=lambda r: (r.made, r.path)))

    def forget(self, records: Sequence[AsideRecord]) -> None:
        gone = set(records)
        with self._lock:
            self.kept = [r for r in self.kept if r not in gone]


if TYPE_CHECKING:

    def _is_aside_log(log: FakeAsideLog) -> AsideLog:
        return log
