"""Issue 21 (11b): the daemon's heap helpers never raise; an operator's MALLOC_ARENA_MAX wins."""

from __future__ import annotations

import pytest

from ckptd.daemon import heap


def test_trim_never_raises() -> None:
    heap.trim()
    heap.trim()


def test_an_operators_malloc_arena_max_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    calls: list[object] = []
    monkeypatch.setattr(heap, "_LIBC", type("Libc", (), {
        "mallopt": staticmethod(lambda *a: calls.append(a) or 1)})())
    assert heap.limit_arenas(2) is True
    assert calls == []


def test_without_glibc_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(heap, "_LIBC", None)
    assert heap.limit_arenas(2) is False
    heap.trim()
