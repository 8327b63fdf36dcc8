"""``MemoryPolicyRepo``: a ``PolicyRepo`` in memory; ``saves`` counts the saves."""

from __future__ import annotations

from collections.abc import Sequence

from ckptd.domain import Policy


class MemoryPolicyRepo:
    """Policies kept in a list; a new repo over the same ``saved`` is a daemon restart."""

    def __init__(self, saved: list[Policy] | None = None) -> None:
        self.saved: list[Policy] = saved if saved is not None else []
        self.saves = 0

    def load(self) -> list[Policy]:
        return list(self.saved)

    def save(self, policies: Sequence[Policy]) -> None:
        self.saved[:] = list(policies)
        self.saves += 1
