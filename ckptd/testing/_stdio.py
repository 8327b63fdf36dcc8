"""``FakeStdioProvider``: a ``StdioProvider`` handing out /dev/null descriptors."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.core.ports import InheritFd
from ckptd.domain import StdioFact
from ckptd.errors import ProcessNotFound

if TYPE_CHECKING:
    from ckptd.core.ports import StdioProvider


class FakeStdioProvider:
    """A ``StdioProvider`` (see ``ckptd.core.ports``) that opens /dev/null for every distinct
    ``external_key`` of ``stdio`` (read-write) and closes those descriptors when the context
    exits, whatever happens inside it. It never creates ``output_path``.

    Records: ``calls`` (``(stdio, output_path)`` per ``replacements``), ``opened`` and
    ``closed`` (descriptor numbers, in order); ``open_fds`` are the ones not closed yet. With
    ``events``, ``"stdio.open"`` / ``"stdio.close"`` are appended. ``fail``, when set, is
    raised on entering the context (nothing opened). Thread-safe.
    """

    def __init__(self, *, events: list[str] | None = None) -> None:
        self._lock = threading.Lock()
        self.events = events
        self.calls: list[tuple[tuple[StdioFact, ...], Path]] = []
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.fail: Exception | None = None
        self.from_calls: list[tuple[tuple[StdioFact, ...], int]] = []
        self.gone: set[int] = set()

    @property
    def open_fds(self) -> list[int]:
        """Descriptors handed out and not yet closed."""
        with self._lock:
            closed = list(self.closed)
            return [fd for fd in self.opened if fd not in closed]

    @contextlib.contextmanager
    def replacements(
        self, stdio: Sequence[StdioFact], output_path: Path, owner: tuple[int, int] = (0, 0),
        chosen_by_caller: bool = False,
    ) -> Iterator[tuple[InheritFd, ...]]:
        """One ``InheritFd`` on /dev/null per distinct external key of ``stdio``."""
        with self._lock:
            self.calls.append((tuple(stdio), output_path))
        if self.fail is not None:
            raise self.fail
        ours: dict[str, InheritFd] = {}
        self._event("stdio.open")
        try:
            for fact in stdio:
                if not fact.external_key or fact.external_key in ours:
                    continue
                fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                with self._lock:
                    self.opened.append(fd)
                ours[fact.external_key] = InheritFd(fact.external_key, fd)
            yield tuple(ours.values())
        finally:
            for inherit in ours.values():
                with contextlib.suppress(OSError):
                    os.close(inherit.fd)
                with self._lock:
                    self.closed.append(inherit.fd)
            self._event("stdio.close")

    @contextlib.contextmanager
    def from_process(
        self, stdio: Sequence[StdioFact], pid: int
    ) -> Iterator[tuple[InheritFd, ...]]:
        """As ``replacements`` (one /dev/null per external key), recorded in
        ``from_calls`` as ``(stdio, pid)``; ``gone`` pids raise ProcessNotFound."""
        with self._lock:
            self.from_calls.append((tuple(stdio), pid))
        if pid in self.gone:
            raise ProcessNotFound(f"cannot reopen the stdio of process {pid}: gone", pid=pid)
        with self.replacements(stdio, Path(os.devnull)) as fds:
            yield fds

    def _event(self, text: str) -> None:
        if self.events is not None:
            self.events.append(text)


if TYPE_CHECKING:

    def _is_a_stdio_provider(provider: FakeStdioProvider) -> StdioProvider:
        return provider
