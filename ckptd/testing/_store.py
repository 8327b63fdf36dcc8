"""``MemoryStore``: a ``CheckpointStore`` whose records live in memory."""

from __future__ import annotations

import builtins
import contextlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.core.store.restream import DirectoryImages
from ckptd.domain import CheckpointRecord, GcReport, GroupRecord, VerifyReport
from ckptd.errors import CheckpointNotFound, StoreError

if TYPE_CHECKING:
    from ckptd.core.ports import CheckpointStore, ImageSource, PageSink


class MemoryStore:
    """A ``CheckpointStore`` (see ``ckptd.core.ports``) keeping records in a dict.

    CRIU writes real files, so image directories are real: ``root/staging/<id>/images``
    between ``begin`` and ``commit``, then ``root/checkpoints/<id>/images``. ``root`` is
    created if needed (give it a ``tmp_path``).

    Behaviour, like ``ContentStore``:

    - ``begin`` returns a new empty directory; ``StoreError`` if the id is already staged or
      committed;
    - ``commit`` requires a staged id (else ``StoreError``), fills ``bytes``,
      ``bytes_logical`` and ``bytes_new`` with the size of the image files, and only then
      makes the record visible;
    - ``abort`` forgets a staged id and removes its directory; idempotent;
    - ``list`` is ordered by ``(created, id)``; ``get``/``delete``/``checkout`` of an unknown
      id raise ``CheckpointNotFound``.

    Failure injection: set ``fail_begin``, ``fail_commit`` or ``fail_checkout`` to an
    exception and that call raises it (before changing anything). ``calls`` records
    ``(method, checkpoint id)``; with ``events``, ``"store.<method> <id>"`` is appended too.
    ``open_checkouts`` counts checkouts whose context has not exited. Thread-safe.
    """

    def __init__(
        self, root: Path, *, location: str = "", events: list[str] | None = None
    ) -> None:
        self.root = root
        self.location = location or f"memory:{root}"
        self.events = events
        self._lock = threading.RLock()
        self._records: dict[str, CheckpointRecord] = {}
        self.groups: dict[str, GroupRecord] = {}
        self._staged: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail_begin: Exception | None = None
        self.fail_commit: Exception | None = None
        self.fail_checkout: Exception | None = None
        self.open_checkouts = 0
        self.begun_ghost_bytes: dict[str, int] = {}
        self.gc_compact: list[bool] = []
        for sub in ("staging", "checkpoints"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # ---- helpers for tests ---------------------------------------------------------------

    def staged(self) -> builtins.list[str]:
        """Ids begun and neither committed nor aborted, sorted."""
        with self._lock:
            return sorted(self._staged)

    def staging_dir(self, checkpoint_id: str) -> Path:
        """Where ``begin(checkpoint_id)`` puts (or put) the images."""
        return self.root / "staging" / checkpoint_id / "images"

    def images_dir(self, checkpoint_id: str) -> Path:
        """Where the images of a committed checkpoint are."""
        return self.root / "checkpoints" / checkpoint_id / "images"

    def _record(self, method: str, checkpoint_id: str) -> None:
        self.calls.append((method, checkpoint_id))
        if self.events is not None:
            self.events.append(f"store.{method} {checkpoint_id}")

    # ---- the CheckpointStore port ----------------------------------------------------------

    def page_sink(self, checkpoint_id: str, uid: int) -> PageSink | None:
        """Pages are written into the image directory, always."""
        return None

    def begin(self, checkpoint_id: str, size_hint: int = 0, *, ghost_bytes: int = 0) -> Path:
        """A fresh empty image directory for ``checkpoint_id`` (``ghost_bytes`` recorded in
        ``begun_ghost_bytes``)."""
        with self._lock:
            self.begun_ghost_bytes[checkpoint_id] = ghost_bytes
            self._record("begin", checkpoint_id)
            if self.fail_begin is not None:
                raise self.fail_begin
            if checkpoint_id in self._staged or checkpoint_id in self._records:
                raise StoreError(
                    f"checkpoint {checkpoint_id} already exists", checkpoint_id=checkpoint_id
                )
            images = self.staging_dir(checkpoint_id)
            if images.parent.exists():
                shutil.rmtree(images.parent)
            images.mkdir(parents=True)
            self._staged.add(checkpoint_id)
            return images

    def commit(self, record: CheckpointRecord) -> CheckpointRecord:
        """Make ``record`` visible, with its sizes filled in."""
        with self._lock:
            self._record("commit", record.id)
            if self.fail_commit is not None:
                raise self.fail_commit
            if record.id not in self._staged:
                raise StoreError(
                    f"cannot commit checkpoint {record.id}: it was not begun (or was aborted)",
                    checkpoint_id=record.id,
                )
            staging = self.staging_dir(record.id)
            size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
            final = self.images_dir(record.id)
            final.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(final)
            shutil.rmtree(staging.parent, ignore_errors=True)
            record = replace(record, bytes=size, bytes_logical=size, bytes_new=size)
            self._staged.discard(record.id)
            self._records[record.id] = record
            return record

    def abort(self, checkpoint_id: str) -> None:
        """Forget a staged checkpoint and remove its directory. Idempotent."""
        with self._lock:
            self._record("abort", checkpoint_id)
            self._staged.discard(checkpoint_id)
            if checkpoint_id not in self._records:
                shutil.rmtree(self.staging_dir(checkpoint_id).parent, ignore_errors=True)

    def put_group(self, group: GroupRecord) -> None:
        """Record a group (idempotent)."""
        with self._lock:
            self._record("put_group", group.id)
            self.groups.setdefault(group.id, group)

    def list_groups(self) -> builtins.list[GroupRecord]:
        with self._lock:
            return sorted(self.groups.values(), key=lambda g: (g.created, g.id))

    def list(self) -> builtins.list[CheckpointRecord]:
        """Committed records, oldest first (by ``created``, then id)."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.created, r.id))

    def get(self, checkpoint_id: str) -> CheckpointRecord:
        """The committed record; CheckpointNotFound if there is none."""
        with self._lock:
            try:
                return self._records[checkpoint_id]
            except KeyError:
                raise CheckpointNotFound(
                    f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id
                ) from None

    def delete(self, checkpoint_id: str) -> None:
        """Remove a committed checkpoint and its images; CheckpointNotFound if unknown."""
        with self._lock:
            self._record("delete", checkpoint_id)
            self.get(checkpoint_id)
            del self._records[checkpoint_id]
            shutil.rmtree(self.images_dir(checkpoint_id).parent, ignore_errors=True)

    @contextlib.contextmanager
    def checkout(self, checkpoint_id: str) -> Iterator[Path]:
        """The committed image directory of ``checkpoint_id``."""
        with self._lock:
            self._record("checkout", checkpoint_id)
            self.get(checkpoint_id)
            if self.fail_checkout is not None:
                raise self.fail_checkout
            self.open_checkouts += 1
        try:
            yield self.images_dir(checkpoint_id)
        finally:
            with self._lock:
                self.open_checkouts -= 1

    @contextlib.contextmanager
    def checkout_streamed(self, checkpoint_id: str, *, lazy: bool = False
                          ) -> Iterator[tuple[Path, ImageSource]]:
        """An empty directory of its own and the committed images read as they are
        (``DirectoryImages``; ``lazy``: nothing to check or plan in a directory)."""
        del lazy
        with self.checkout(checkpoint_id) as images, \
                tempfile.TemporaryDirectory(prefix=f"stream-{checkpoint_id}-") as empty:
            yield Path(empty), DirectoryImages(images, checkpoint_id)

    def verify(self, checkpoint_id: str = "") -> VerifyReport:
        """Checks that every committed image directory still exists."""
        with self._lock:
            ids = [checkpoint_id] if checkpoint_id else sorted(self._records)
            if checkpoint_id and checkpoint_id not in self._records:
                raise CheckpointNotFound(
                    f"no checkpoint {checkpoint_id}", checkpoint_id=checkpoint_id
                )
        problems = tuple(
            f"checkpoint {cid}: images missing" for cid in ids if not self.images_dir(cid).is_dir()
        )
        return VerifyReport(checked=tuple(ids), problems=problems)

    def collect_garbage(
        self, delete_first: tuple[str, ...] = (), *, compact: bool = True
    ) -> GcReport:
        """Deletes ``delete_first``; a memory store has no other garbage (``compact``, as
        asked, is recorded in ``gc_compact``)."""
        self.gc_compact.append(compact)
        for cid in delete_first:
            self.delete(cid)
        return GcReport(deleted_checkpoints=delete_first)


if TYPE_CHECKING:

    def _is_a_store(store: MemoryStore) -> CheckpointStore:
        return store
