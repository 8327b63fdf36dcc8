"""PidLocks: one operation per pid, refused (never queued) with Busy."""

from __future__ import annotations

import pytest

from ckptd.core.locks import PidLocks
from ckptd.errors import Busy


def test_second_holder_is_busy_and_release_frees() -> None:
    locks = PidLocks()
    with locks.hold(10, "a checkpoint"):
        with pytest.raises(Busy) as info, locks.hold(10, "a restore"):
            pass
        assert info.value.pid == 10
        assert "pid 10 is busy: a checkpoint is in progress" in str(info.value)
        with locks.hold(11, "a restore"):
            pass
    with locks.hold(10, "a restore"):
        pass


def test_released_when_the_body_raises() -> None:
    locks = PidLocks()
    with pytest.raises(RuntimeError), locks.hold(10, "x"):
        raise RuntimeError("boom")
    with locks.hold(10, "y"):
        pass
