"""``AsideLog``: one small JSON file per restore that kept copies aside (``<restore id>.json``
in ``<state dir>/asides``), written durably (``write_atomic``), at most ``limit`` of them (the
oldest removed first)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from ckptd.adapters.storage.fsutil import fsync_dir, write_atomic
from ckptd.core.ports.asides import AsideRecord

log = logging.getLogger(__name__)

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

LIMIT = 4096
"""Restores whose records are kept: beyond it the oldest are forgotten (their copies stay, for
the user to remove by hand)."""


class FileAsideLog:
    def __init__(self, root: Path, limit: int = LIMIT) -> None:
        self._root = root
        self._limit = limit
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in root.glob(".*.json.tmp.*"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()

    def add(self, records: Sequence[AsideRecord]) -> None:
        if not records:
            return
        restore_id = records[0].restore_id
        if not _ID.match(restore_id) or any(r.restore_id != restore_id for r in records):
            raise ValueError(f"aside records of restore {restore_id!r}: one restore id each")
        with self._lock:
            kept = self._read(restore_id) + list(records)
            self._write(restore_id, kept)
            files = sorted(self._root.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
            for old in files[: max(0, len(files) - self._limit)]:
                log.info("aside records of restore %s forgotten (more than %d restores "
                         "recorded); its copies, if still there, are left for their owner",
                         old.stem, self._limit)
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()

    def records(self) -> tuple[AsideRecord, ...]:
        with self._lock:
            found = [r for path in self._root.glob("*.json") for r in self._read(path.stem)]
        return tuple(sorted(found, key=lambda r: (r.made, r.path)))

    def forget(self, records: Sequence[AsideRecord]) -> None:
        gone = set(records)
        with self._lock:
            for restore_id in sorted({r.restore_id for r in records}):
                if not _ID.match(restore_id):
                    continue
                kept = [r for r in self._read(restore_id) if r not in gone]
                self._write(restore_id, kept)

    def _read(self, restore_id: str) -> list[AsideRecord]:
        path = self._root / f"{restore_id}.json"
        try:
            data = json.loads(path.read_bytes())
            return [AsideRecord.from_json(item) for item in data]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("aside records %s cannot be read (%s): left out", path, exc)
            return []

    def _write(self, restore_id: str, records: list[AsideRecord]) -> None:
        path = self._root / f"{restore_id}.json"
        if records:
            write_atomic(path, json.dumps([r.to_json() for r in records]).encode())
            return
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            fsync_dir(self._root)
