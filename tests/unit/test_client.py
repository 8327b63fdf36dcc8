"""ckptd.client: the decision to commit a group is taken only while every member is surely
still held."""

from __future__ import annotations

import time

from ckptd.client import _too_slow


def test_a_group_whose_prepare_took_most_of_hold_s_is_not_committed() -> None:
    assert _too_slow(time.monotonic(), 60.0) == []
    slow = _too_slow(time.monotonic() - 50.0, 60.0)
    assert len(slow) == 1 and "larger hold_s" in slow[0]
