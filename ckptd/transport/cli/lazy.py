"""Modules ``ckptctl`` imports on first use, not at start-up (issue 25, the small job).

``ckptctl`` is a short-lived process: every module imported at start-up is paid on every
command. gRPC (with asyncio, ~35 ms), the generated protobuf modules (~15 ms) and ckptd's own
domain and adapters are imported only by the commands that use them: ``ckptctl --help``, a
usage error and ``ckptctl completion bash`` import none of them, ``ckptctl dump PID`` only
gRPC and the messages (``tests/unit/cli/test_cli_imports.py`` holds this).

A module is named with :func:`module`, typed by a ``TYPE_CHECKING`` import of the same name::

    if TYPE_CHECKING:
        import grpc
    else:
        grpc = lazy.module("grpc")

Invariant: the proxy imports its module on the first attribute read and then forwards every
read to it; an import error surfaces at that read, as the same exception ``import`` raises.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


class LazyModule:
    """A stand-in for the module ``name``, imported on the first attribute read."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> object:
        loaded: ModuleType | None = sys.modules.get(self._name)
        if loaded is None:
            loaded = importlib.import_module(self._name)
        return getattr(loaded, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def module(name: str) -> LazyModule:
    """The module ``name``, imported when first used."""
    return LazyModule(name)
