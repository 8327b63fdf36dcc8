"""Checkpoint storage and the daemon's durable journal."""

from ckptd.adapters.storage.journal import FileJournal
from ckptd.adapters.storage.local import LocalImageStore

__all__ = ["FileJournal", "LocalImageStore"]
