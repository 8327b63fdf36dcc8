"""The checkpoint store and the object storage it may sit on."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckptd.core.ports.criu import ImageSource, PageSink
from ckptd.domain import CheckpointRecord, GcReport, GroupRecord, VerifyReport

if TYPE_CHECKING:
    from typing_extensions import Buffer


class CheckpointCatalog(Protocol):
    """The committed checkpoints: listed, read, deleted."""

    location: str

    def list(self) -> list[CheckpointRecord]:
        """Committed checkpoints, oldest first."""
        ...

    def get(self, checkpoint_id: str) -> CheckpointRecord: ...

    def delete(self, checkpoint_id: str) -> None: ...


class CheckpointStaging(Protocol):
    """A checkpoint being written: staged, then committed (visible) or aborted."""

    def begin(self, checkpoint_id: str, size_hint: int = 0, *, ghost_bytes: int = 0) -> Path:
        """A fresh empty directory for CRIU's images of ``checkpoint_id`` (about
        ``size_hint`` bytes of them, 0 if unknown; ``ghost_bytes`` of them ghost files: not
        pages, staged even when pages are streamed)."""
        ...

    def page_sink(self, checkpoint_id: str, uid: int) -> PageSink | None:
        """Where CRIU may send the pages of a begun ``checkpoint_id`` (owned by ``uid``) as it
        dumps, instead of writing pages images into its directory; None: write them there."""
        ...

    def commit(self, record: CheckpointRecord) -> CheckpointRecord:
        """Make ``record`` (and the images in its directory) durable and visible; returns the
        record with its sizes filled in."""
        ...

    def abort(self, checkpoint_id: str) -> None:
        """Forget an uncommitted checkpoint. Idempotent."""
        ...


class CheckpointCheckouts(Protocol):
    """A committed checkpoint's images for CRIU to restore from."""

    def checkout(self, checkpoint_id: str) -> AbstractContextManager[Path]:
        """A CRIU image directory for restoring ``checkpoint_id``, valid inside the context."""
        ...

    def checkout_streamed(
        self, checkpoint_id: str, *, lazy: bool = False
    ) -> AbstractContextManager[tuple[Path, ImageSource]]:
        """For a streamed restore: an empty directory of its own (for CRIU's socket, logs
        and whatever the restore writes there) and the checkpoint's images read from the
        store as they are asked for; both valid inside the context (the store's objects are
        kept from GC meanwhile). Every pack's structure is checked first, unless ``lazy`` (a
        lazy restore: the job runs before its pages are read, and each is verified when it
        is; read a few at a time, they are not planned ahead either)."""
        ...


class StoreMaintenance(Protocol):
    """Reading everything back, and collecting what no checkpoint needs."""

    def verify(self, checkpoint_id: str = "") -> VerifyReport:
        """Read back one checkpoint (or everything) and name every damaged object."""
        ...

    def collect_garbage(
        self, delete_first: tuple[str, ...] = (), *, compact: bool = True
    ) -> GcReport:
        """Delete ``delete_first``, then every object no checkpoint needs (a dump in
        progress keeps what it wrote); then, if ``compact``, rewrite what is mostly garbage
        (that needs new space: a full store skips it, ``GcReport.skipped``)."""
        ...


class GroupRecords(Protocol):
    """The records of group checkpoints (written once every member is committed)."""

    def put_group(self, group: GroupRecord) -> None:
        """Make a group checkpoint visible (after every member's checkpoint is committed);
        writing the same group twice is not an error."""
        ...

    def list_groups(self) -> builtins.list[GroupRecord]: ...


class CheckpointStore(CheckpointCatalog, CheckpointStaging, CheckpointCheckouts,
                      StoreMaintenance, GroupRecords, Protocol):
    """Where checkpoints live (its families: catalog, staging, checkouts, maintenance, groups).

    Invariants: ``list``/``get`` see a checkpoint only after ``commit`` returned, and then
    everything it needs is durable; ``abort`` and a crash before ``commit`` leave nothing
    visible; ``checkout`` yields a complete CRIU image directory or raises.
    """


class BlobStore(Protocol):
    """Where the content-addressed store keeps its objects: local disk, NFS, object stores.

    Keys are ``/``-separated relative names (``packs/ab/abcd...``). Invariants: ``put`` writes
    a whole object or nothing (a reader never sees part of one); with ``if_absent`` an
    existing object is left as is and ``put`` returns False; after ``flush`` returns, every
    object put before it survives a crash of this host; ``get`` of a missing key raises
    ``BlobNotFound``; ``delete`` of a missing key is not an error.
    """

    location: str

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool: ...

    def put_parts(
        self, key: str, parts: Sequence[Buffer], *, if_absent: bool = False
    ) -> bool:
        """``put`` of the parts concatenated (a store on a file system writes them as they
        are, without joining them first)."""
        ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (``end`` None: to its end)."""
        ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        """``(key, modified time)`` of every object under ``prefix``."""
        ...

    def delete(self, key: str) -> None: ...

    def flush(self) -> None: ...
