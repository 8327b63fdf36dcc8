"""run_steps: ordered steps, rollback newest first, undo failures as notes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckptd.core.recipe import Step, run_steps
from ckptd.domain import Progress

Log = list[str]


def _step(name: str, fail: bool = False, undo: bool = True, undo_fails: bool = False) -> Step[Log]:
    def do(log: Log) -> None:
        log.append(f"do {name}")
        if fail:
            raise ValueError(f"{name} failed")

    def undo_fn(log: Log) -> None:
        log.append(f"undo {name}")
        if undo_fails:
            raise OSError(f"undo of {name} failed")

    return Step(name, do, undo_fn if undo else None)


def test_all_steps_run_in_order_with_progress() -> None:
    log: Log = []
    seen: list[Progress] = []
    run_steps([_step("a"), _step("b"), _step("c")], log, seen.append)
    assert log == ["do a", "do b", "do c"]
    assert [(p.stage, p.fraction) for p in seen] == [
        ("a", 0.0), ("b", 1 / 3), ("c", 2 / 3), ("done", 1.0),
    ]


def test_progress_uses_describe_as_message() -> None:
    seen: list[Progress] = []
    run_steps([Step("a", lambda _: None, None, "doing a")], None, seen.append)
    assert seen[0].message == "doing a"


def test_rollback_is_reverse_and_includes_the_failing_step() -> None:
    log: Log = []
    steps = [_step("a"), _step("b", undo=False), _step("c"), _step("d", fail=True), _step("e")]
    with pytest.raises(ValueError, match="d failed"):
        run_steps(steps, log)
    assert log == ["do a", "do b", "do c", "do d", "undo d", "undo c", "undo a"]


def test_a_failing_undo_is_a_note_and_the_other_undos_still_run() -> None:
    log: Log = []
    cause = KeyError("root cause")
    original = ValueError("c failed")
    original.__cause__ = cause

    def fail_c(log: Log) -> None:
        log.append("do c")
        raise original

    steps = [
        _step("a", undo_fails=True),
        _step("b", undo_fails=True),
        Step("c", fail_c, lambda log: log.append("undo c")),
    ]
    with pytest.raises(ValueError) as info:
        run_steps(steps, log)
    assert info.value is original
    assert info.value.__cause__ is cause
    assert str(info.value) == "c failed"
    assert log == ["do a", "do b", "do c", "undo c", "undo b", "undo a"]
    assert info.value.__notes__ == [
        "rollback of step 'b' also failed: undo of b failed",
        "rollback of step 'a' also failed: undo of a failed",
    ]


def test_nothing_is_undone_on_success() -> None:
    log: Log = []
    run_steps([_step("a"), _step("b")], log)
    assert not any(entry.startswith("undo") for entry in log)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_roll_back_too(error: Callable[[], BaseException]) -> None:
    log: Log = []

    def interrupted(log: Log) -> None:
        raise error()

    with pytest.raises(error):  # type: ignore[call-overload]
        run_steps([_step("a"), Step("b", interrupted, lambda log: log.append("undo b"))], log)
    assert log == ["do a", "undo b", "undo a"]


def test_no_progress_after_a_failure() -> None:
    seen: list[str] = []
    with pytest.raises(ValueError):
        run_steps([_step("a", fail=True), _step("b")], [], lambda p: seen.append(p.stage))
    assert seen == ["a"]
