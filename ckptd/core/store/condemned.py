"""Condemned lists: the first phase of garbage collection on a store several daemons share.

A GC run does not delete an unreferenced object at once: it lists it in a *condemned list*
(``gc/condemned-<time>-<random>``, JSON: when it was written, when its objects become due,
and the pack ids and blob hashes it condemns). A later run deletes an object only when a list
has made it due and no manifest names it then. Dumps never deduplicate against a condemned
object (they store it again, which gives it a fresh modification time that their lease
protects), and a commit checks right before its manifest that nothing it names is due.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptd.core.ports import BlobStore
from ckptd.errors import BlobNotFound

CONDEMNED_PREFIX = "gc/condemned-"


def condemned_key(now: float) -> str:
    """Sortable by time; the random part keeps two nodes' lists apart."""
    return f"{CONDEMNED_PREFIX}{now:017.6f}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class CondemnedList:
    key: str
    time: float
    due: float
    packs: frozenset[str]
    blobs: frozenset[str]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": 1,
                "time": self.time,
                "due": self.due,
                "packs": sorted(self.packs),
                "blobs": sorted(self.blobs),
            }
        ).encode()

    def with_only(self, packs: Iterable[str], blobs: Iterable[str]) -> CondemnedList:
        return CondemnedList(self.key, self.time, self.due, frozenset(packs), frozenset(blobs))


@dataclass
class Condemned:
    """Every live condemned list, and per object the earliest time it is due."""

    lists: list[CondemnedList] = field(default_factory=list)
    packs: dict[str, float] = field(default_factory=dict)
    blobs: dict[str, float] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)
    """Keys of lists that do not parse (GC deletes them)."""

    def due_packs(self, now: float) -> set[str]:
        return {p for p, due in self.packs.items() if due <= now}

    def due_blobs(self, now: float) -> set[str]:
        return {b for b, due in self.blobs.items() if due <= now}


def load_condemned(blobs: BlobStore) -> Condemned:
    """Read every condemned list. One deleted meanwhile is skipped; one that does not parse
    is skipped too (it then condemns nothing: nothing is deleted on its account) and listed
    in ``damaged``."""
    out = Condemned()
    for key, _mtime in list(blobs.list(CONDEMNED_PREFIX)):
        try:
            raw = json.loads(blobs.get(key))
            entry = CondemnedList(
                key=key,
                time=float(raw["time"]),
                due=float(raw["due"]),
                packs=frozenset(str(p) for p in raw["packs"]),
                blobs=frozenset(str(b) for b in raw["blobs"]),
            )
        except BlobNotFound:
            continue
        except (ValueError, KeyError, TypeError):
            out.damaged.append(key)
            continue
        out.lists.append(entry)
        for p in entry.packs:
            out.packs[p] = min(out.packs.get(p, entry.due), entry.due)
        for b in entry.blobs:
            out.blobs[b] = min(out.blobs.get(b, entry.due), entry.due)
    return out
