"""``Journal``: one small JSON file per operation in flight, written durably."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptd.adapters.storage.fsutil import fsync_dir, write_atomic


class FileJournal:
    """Opened by the one daemon that holds the state directory: a temporary file a crash left
    in the middle of ``begin`` (``.<op>.json.tmp.<pid>``, never a record) is removed then."""

    def __init__(self, root: Path) -> None:
        self._root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in root.glob(".*.json.tmp.*"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()

    def begin(self, op_id: str, facts: dict[str, Any]) -> None:
        write_atomic(self._root / f"{op_id}.json", json.dumps(facts).encode())

    def end(self, op_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._root / f"{op_id}.json").unlink()
            fsync_dir(self._root)

    def pending(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for path in sorted(self._root.glob("*.json")):
            try:
                facts = json.loads(path.read_text())
            except (OSError, ValueError):
                facts = {}
            yield path.stem, facts


def annotate(
    root: Path, op_id: str, update: Callable[[dict[str, Any]], dict[str, Any]]
) -> bool:
    """Replace the entry of ``op_id`` in the journal at ``root`` by ``update(entry)``,
    atomically and durably (e.g. ``core.undo.with_guard_resumed``: a record appended to the
    typed entry). For a process other than the daemon that owns the journal (the guard), and
    only once that daemon is dead. True when written, or when there is no entry (the operation
    ended); False when the entry could not be read, updated (``update`` raised ValueError) or
    written."""
    path = root / f"{op_id}.json"
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    if not isinstance(entry, dict):
        return False
    try:
        write_atomic(path, json.dumps(update(entry)).encode())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return True
