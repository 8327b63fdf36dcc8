"""Contract of ``Clock``: the system clock and ``FakeClock`` behave the same (see core/ports/).

Implementations are listed in ``CLOCKS`` (a new one is one line there)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckptd.adapters.clock import SystemClock
from ckptd.core.ports import Clock
from ckptd.testing import FakeClock

CLOCKS: dict[str, Callable[[], Clock]] = {"system": SystemClock, "fake": FakeClock}


@pytest.fixture(params=sorted(CLOCKS))
def clock(request: pytest.FixtureRequest) -> Clock:
    return CLOCKS[request.param]()


def test_time_is_seconds_since_the_epoch(clock: Clock) -> None:
    assert 1.5e9 < clock.time() < 4.1e9  # between 2017 and 2100


def test_monotonic_never_goes_back(clock: Clock) -> None:
    readings = [clock.monotonic() for _ in range(100)]
    assert readings == sorted(readings)


def test_sleep_moves_both_clocks_by_at_least_its_length(clock: Clock) -> None:
    t0, m0 = clock.time(), clock.monotonic()
    clock.sleep(0.02)
    assert clock.monotonic() - m0 >= 0.02 - 1e-9  # (float rounding)
    assert clock.time() - t0 >= 0.019  # the wall clock may be coarser


def test_sleep_zero_returns(clock: Clock) -> None:
    m0 = clock.monotonic()
    clock.sleep(0)
    assert clock.monotonic() >= m0


def test_a_negative_sleep_is_refused(clock: Clock) -> None:
    with pytest.raises(ValueError):
        clock.sleep(-1)
