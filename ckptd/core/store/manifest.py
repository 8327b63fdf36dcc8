"""The manifest of one checkpoint: the last object a dump writes, the first a restore reads.

It names everything the checkpoint needs — so it alone decides what GC must keep — and carries
its own checksum: a damaged manifest is refused, never half-read.

Serialized as ``<json>\\n<xxh3-128 hex of the json>\\n``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptd.domain import CheckpointRecord
from ckptd.errors import CorruptCheckpoint

FORMAT = 1


@dataclass(frozen=True)
class FileEntry:
    """One CRIU image file. ``blob`` for a file stored whole; ``pagelist`` (and the full
    list it is a delta of, ``pagelist_base``) for a pages image."""

    name: str
    size: int
    blob: str = ""
    pagelist: str = ""
    pagelist_base: str = ""
    pages: int = 0


@dataclass(frozen=True)
class Manifest:
    record: CheckpointRecord
    uid: int
    files: tuple[FileEntry, ...]
    packs: tuple[str, ...]
    blobs: tuple[str, ...] = field(default=())

    def to_bytes(self) -> bytes:
        body = json.dumps(
            {
                "format": FORMAT,
                "record": self.record.to_json(),
                "uid": self.uid,
                "files": [vars(f) for f in self.files],
                "packs": list(self.packs),
                "blobs": list(self.blobs),
            },
            sort_keys=True,
        ).encode()
        return body + b"\n" + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Manifest:
        body, _, rest = data.rstrip(b"\n").rpartition(b"\n")
        if not body or xxhash.xxh3_128_hexdigest(body).encode() != rest:
            raise CorruptCheckpoint(
                f"manifest of checkpoint {name} is damaged (checksum mismatch)",
                checkpoint_id=name,
            )
        try:
            raw: dict[str, Any] = json.loads(body)
            if raw.get("format") != FORMAT:
                raise CorruptCheckpoint(
                    f"manifest of checkpoint {name} has format {raw.get('format')}, "
                    f"this ckptd reads {FORMAT}",
                    hint="upgrade ckptd",
                    checkpoint_id=name,
                )
            return cls(
                record=CheckpointRecord.from_json(raw["record"]),
                uid=int(raw["uid"]),
                files=tuple(FileEntry(**f) for f in raw["files"]),
                packs=tuple(raw["packs"]),
                blobs=tuple(raw["blobs"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(
                f"manifest of checkpoint {name} is unreadable ({exc})", checkpoint_id=name
            ) from exc
