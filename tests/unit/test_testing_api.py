"""``ckptd.testing`` is public API: everything public is exported, and fakes fit the ports."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import ckptd.testing
from ckptd.core import ports
from ckptd.testing import (
    FakeClock,
    FakeCriu,
    FakeProcessTable,
    FakeStdioProvider,
    LoopbackPeerConnector,
    MemoryJournal,
    MemoryStore,
)


def _submodules() -> list[str]:
    return [
        f"{ckptd.testing.__name__}.{m.name}"
        for m in pkgutil.iter_modules(ckptd.testing.__path__)
    ]


def test_all_is_complete() -> None:
    """Every public class defined in a submodule of ckptd.testing is in ``__all__``."""
    modules = _submodules()
    assert modules, "no submodules found"
    public: set[str] = set()
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and not attr.startswith("_")
            ):
                public.add(attr)
    assert public <= set(ckptd.testing.__all__), public - set(ckptd.testing.__all__)
    assert {"FakeClock", "FakeProcessTable", "FakeCriu", "MemoryStore", "MemoryJournal",
            "FakeStdioProvider"} <= public


def test_all_names_exist_and_are_unique() -> None:
    for name in ckptd.testing.__all__:
        assert hasattr(ckptd.testing, name), name
    assert len(set(ckptd.testing.__all__)) == len(ckptd.testing.__all__)


def test_every_public_class_has_a_docstring() -> None:
    for name in ckptd.testing.__all__:
        value = getattr(ckptd.testing, name)
        if inspect.isclass(value):
            assert inspect.getdoc(value), name


def _protocol_methods(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_fakes_have_every_method_of_their_port(tmp_path: Path) -> None:
    table = FakeProcessTable()
    pairs: list[tuple[type, object]] = [
        (ports.Clock, FakeClock()),
        (ports.ProcessTable, table),
        (ports.Criu, FakeCriu(table)),
        (ports.CheckpointStore, MemoryStore(tmp_path)),
        (ports.Journal, MemoryJournal()),
        (ports.StdioProvider, FakeStdioProvider()),
        (ports.PeerConnector, LoopbackPeerConnector()),
    ]
    for protocol, fake in pairs:
        for method in _protocol_methods(protocol):
            assert callable(getattr(fake, method, None)), (type(fake).__name__, method)
            want = list(inspect.signature(getattr(protocol, method)).parameters)[1:]
            got = list(inspect.signature(getattr(fake, method)).parameters)
            assert got == want, (type(fake).__name__, method)
    assert isinstance(MemoryStore(tmp_path).location, str)
