"""Checkpoint storage backends and the daemon's durable journal."""

from ckptd.adapters.storage.journal import FileJournal
from ckptd.adapters.storage.localfs import LocalBlobStore

__all__ = ["FileJournal", "LocalBlobStore"]
