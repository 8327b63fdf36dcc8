"""A checkpoint store on a local (or NFS) directory, CRIU images kept as files.

Layout under the root::

    staging/<id>/images/...          a dump in progress (never listed)
    checkpoints/<id>/images/...      committed CRIU images
    checkpoints/<id>/record.json     the checkpoint's facts
    trash/<id>/                      being deleted

Commit: every image file is fsynced, ``record.json`` written into the staging directory, then
the whole directory is renamed into ``checkpoints/`` (atomic on one file system) and the
parent fsynced. So a checkpoint is visible only complete; a crash leaves at most a staging
directory, removed at the next start.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from ckptd.adapters.storage.fsutil import fsync_dir, fsync_tree, write_atomic
from ckptd.domain import CheckpointRecord
from ckptd.domain.model import is_checkpoint_id
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint, StoreError


class LocalImageStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)
        for sub in ("staging", "checkpoints", "trash"):
            (root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    def _dir(self, checkpoint_id: str) -> Path:
        if not is_checkpoint_id(checkpoint_id):
            raise CheckpointNotFound(
                f"{checkpoint_id!r} is not a checkpoint id", checkpoint_id=checkpoint_id
            )
        return self.root / "checkpoints" / checkpoint_id

    def begin(self, checkpoint_id: str) -> Path:
        images = self.root / "staging" / checkpoint_id / "images"
        try:
            images.mkdir(parents=True, mode=0o700)
        except OSError as exc:
            raise StoreError(
                f"cannot create {images}: {exc}", checkpoint_id=checkpoint_id
            ) from exc
        return images

    def commit(self, record: CheckpointRecord) -> CheckpointRecord:
        staging = self.root / "staging" / record.id
        try:
            size = fsync_tree(staging / "images")
            record = replace(record, bytes=size, bytes_logical=size, bytes_new=size)
            write_atomic(staging / "record.json", json.dumps(record.to_json()).encode())
            os.rename(staging, self.root / "checkpoints" / record.id)
            fsync_dir(self.root / "checkpoints")
            fsync_dir(self.root / "staging")
        except OSError as exc:
            raise StoreError(
                f"cannot commit checkpoint {record.id}: {exc}",
                hint="check free space and permissions of the store",
                checkpoint_id=record.id,
            ) from exc
        return record

    def abort(self, checkpoint_id: str) -> None:
        shutil.rmtree(self.root / "staging" / checkpoint_id, ignore_errors=True)

    def list(self) -> list[CheckpointRecord]:
        out = []
        for path in (self.root / "checkpoints").glob("*/record.json"):
            with contextlib.suppress(CorruptCheckpoint, FileNotFoundError):
                out.append(self._read(path))
        return sorted(out, key=lambda r: (r.created, r.id))

    def _read(self, path: Path) -> CheckpointRecord:
        try:
            return CheckpointRecord.from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpoint(
                f"checkpoint record {path} is unreadable: {exc}", checkpoint_id=path.parent.name
            ) from exc

    def get(self, checkpoint_id: str) -> CheckpointRecord:
        path = self._dir(checkpoint_id) / "record.json"
        if not path.is_file():
            raise CheckpointNotFound(
                f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id
            )
        return self._read(path)

    def delete(self, checkpoint_id: str) -> None:
        src = self._dir(checkpoint_id)
        if not (src / "record.json").is_file():
            raise CheckpointNotFound(
                f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id
            )
        dst = self.root / "trash" / checkpoint_id
        os.rename(src, dst)
        fsync_dir(self.root / "checkpoints")
        shutil.rmtree(dst, ignore_errors=True)

    @contextlib.contextmanager
    def checkout(self, checkpoint_id: str) -> Iterator[Path]:
        self.get(checkpoint_id)
        yield self._dir(checkpoint_id) / "images"

    def clean(self) -> builtins.list[str]:
        """Remove what a crash left behind (staging and trash). Returns what was removed."""
        removed = []
        for sub in ("staging", "trash"):
            for path in (self.root / sub).iterdir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{sub}/{path.name}")
        return removed
