"""Checkpoint storage backends and the daemon's durable journal."""

from ckptd.adapters.storage.journal import FileJournal
from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.adapters.storage.objstore import ObjectBlobStore
from ckptd.adapters.storage.policyfile import JsonPolicyRepo
from ckptd.adapters.storage.url import open_blob_store

__all__ = [
    "FileJournal", "JsonPolicyRepo", "LocalBlobStore", "ObjectBlobStore", "open_blob_store",
]
