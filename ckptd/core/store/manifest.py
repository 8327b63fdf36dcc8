"""The manifest of one checkpoint: the last object a dump writes, the first a restore reads.

It names everything the checkpoint needs — so it alone decides what GC must keep — and is
authenticated (docs/adr/0014-authenticated-manifests.md): serialized as
``<json>\\n<key id> <hex HMAC-SHA256 of the json>\\n`` (format 2), the JSON naming the
checkpoint id and the store it belongs to. Objects are named by their content (keyed hashes,
ADR 0005), so the MAC binds the id to every object the checkpoint restores from.

Invariants of a manifest ``from_bytes`` returns: its MAC verified with a key this node holds
*before* its JSON is parsed; it names the checkpoint it is stored as (a manifest copied over
another checkpoint's is refused), this store, and the same uid as its record. Anything else
is refused with a ``CorruptCheckpoint`` naming the checkpoint and what is wrong: never
half-read. Format 1 (``<json>\\n<xxh3-128 hex>\\n``, no MAC, before ADR 0014) is refused by
``from_bytes``; ``from_legacy_bytes`` reads one for the store's one-time adoption.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptd.core.store.keys import ManifestKeys
from ckptd.domain import CheckpointRecord
from ckptd.errors import CorruptCheckpoint

FORMAT = 2
LEGACY_FORMAT = 1
SHARE_KEYS_HINT = (
    "every node sharing a store needs the same manifest key file (manifest_keys; README, "
    "'Shared stores')"
)
ADOPT_HINT = (
    "if the store was not tampered with, adopt its old manifests once: start ckptd with "
    "adopt_unauthenticated = true or --adopt-unauthenticated (docs/store-format.md, "
    "'Upgrading')"
)


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

    def _fields(self) -> dict[str, Any]:
        return {
            "record": self.record.to_json(),
            "uid": self.uid,
            "files": [vars(f) for f in self.files],
            "packs": list(self.packs),
            "blobs": list(self.blobs),
        }

    def to_bytes(self, keys: ManifestKeys, store_id: str) -> bytes:
        """Format 2, signed with the signing key of ``keys``, bound to the record's id and
        to ``store_id``."""
        body = json.dumps(
            {"format": FORMAT, "id": self.record.id, "store": store_id, **self._fields()},
            sort_keys=True,
        ).encode()
        kid, mac = keys.sign(body)
        return body + b"\n" + f"{kid} {mac}".encode() + b"\n"

    @classmethod
    def from_bytes(
        cls, data: bytes, name: str, keys: ManifestKeys, store_id: str
    ) -> Manifest:
        """The manifest stored as checkpoint ``name``, authenticated (module docstring)."""
        body, _, last = data.rstrip(b"\n").rpartition(b"\n")
        kid, _, mac = last.decode("ascii", "replace").partition(" ")
        if not body:
            raise _refused(name, "is damaged (no body)")
        if not mac:  # one token: the xxh3 checksum of format 1
            if _legacy_intact(body, last):
                raise _refused(name, "is not authenticated (format 1: written before ckptd "
                               "signed manifests, or forged)", hint=ADOPT_HINT)
            raise _refused(name, "is damaged or was edited (no valid authentication)")
        if not keys.holds(kid):
            raise _refused(
                name, f"is signed with key {kid[:16]!r}, which this node does not hold "
                f"(it holds {', '.join(keys.ids)})", hint=SHARE_KEYS_HINT,
            )
        if not keys.check(kid, body, mac):
            raise _refused(name, "is damaged or was edited (authentication failed)")
        raw = _json(body, name)  # authentic from here on
        if raw.get("format") != FORMAT:
            raise _refused(name, f"has format {raw.get('format')}, this ckptd reads {FORMAT}",
                           hint="upgrade ckptd")
        if raw.get("id") != name:
            raise _refused(name, f"is the manifest of checkpoint {str(raw.get('id'))[:80]}, "
                           "copied over it (swapped or replayed)")
        if raw.get("store") != store_id:
            raise _refused(name, f"belongs to another store ({str(raw.get('store'))[:40]}), "
                           "copied into this one")
        return cls._checked(raw, name)

    @classmethod
    def from_legacy_bytes(cls, data: bytes, name: str) -> Manifest:
        """A format-1 manifest (unauthenticated: only for adoption), checked as far as it can
        be: its checksum, and that it names the checkpoint it is stored as."""
        body, _, last = data.rstrip(b"\n").rpartition(b"\n")
        if not body or not _legacy_intact(body, last):
            raise _refused(name, "is damaged (checksum mismatch)")
        raw = _json(body, name)
        if raw.get("format") != LEGACY_FORMAT:
            raise _refused(name, f"has format {raw.get('format')}, not {LEGACY_FORMAT}")
        return cls._checked(raw, name)

    @classmethod
    def _checked(cls, raw: dict[str, Any], name: str) -> Manifest:
        try:
            manifest = cls(
                record=CheckpointRecord.from_json(raw["record"]),
                uid=int(raw["uid"]),
                files=tuple(FileEntry(**f) for f in raw["files"]),
                packs=tuple(raw["packs"]),
                blobs=tuple(raw["blobs"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _refused(name, f"is unreadable ({exc})") from exc
        if manifest.record.id != name:
            raise _refused(name, f"holds the record of checkpoint "
                           f"{str(manifest.record.id)[:80]} (swapped or replayed)")
        if manifest.record.uid != manifest.uid:
            raise _refused(name, f"names owner uid {manifest.uid} but its record uid "
                           f"{manifest.record.uid}")
        return manifest


def names_unverified(data: bytes) -> tuple[list[str], list[str]]:
    """The packs and blobs ``data`` names, *without authenticating it*: only for GC, which
    keeps what any manifest names (a refused one may be valid for another node). Empty
    when it cannot be parsed."""
    body = data.rstrip(b"\n").rpartition(b"\n")[0]
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return [], []
    if not isinstance(raw, dict):
        return [], []
    packs, blobs = raw.get("packs"), raw.get("blobs")
    return (
        [p for p in packs if isinstance(p, str)] if isinstance(packs, list) else [],
        [b for b in blobs if isinstance(b, str)] if isinstance(blobs, list) else [],
    )


def is_legacy(data: bytes) -> bool:
    """Whether ``data`` has the shape of a format-1 manifest (a checksum, no key id and MAC),
    intact or not."""
    last = data.rstrip(b"\n").rpartition(b"\n")[2]
    return b" " not in last


def signer(data: bytes) -> str | None:
    """The key id a format-2 manifest names (16 hex digits), *without authenticating it*:
    only to count manifests by key. None when ``data`` does not have that shape."""
    kid, _, mac = data.rstrip(b"\n").rpartition(b"\n")[2].partition(b" ")
    if len(kid) != 16 or len(mac) != 64 or not _hex(kid) or not _hex(mac):
        return None
    return kid.decode("ascii")


def _hex(token: bytes) -> bool:
    return all(c in b"0123456789abcdef" for c in token)


def _legacy_intact(body: bytes, checksum: bytes) -> bool:
    return xxhash.xxh3_128_hexdigest(body).encode() == checksum


def _json(body: bytes, name: str) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise _refused(name, f"is unreadable ({exc})") from exc
    if not isinstance(raw, dict):
        raise _refused(name, "is unreadable (not a JSON object)")
    return raw


def _refused(name: str, what: str, hint: str | None = None) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"manifest of checkpoint {name} {what}", hint=hint,
                             checkpoint_id=name)
