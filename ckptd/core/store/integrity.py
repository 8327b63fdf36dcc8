"""What a daemon checks of its store when it starts, and the adoption of manifests written
before they were authenticated (docs/adr/0014-authenticated-manifests.md).

At start, building the page index reads every pack's footer (end marker, where its trailer
is) and trailer (checksum, frames) — two ranged reads a pack. What that finds damaged is
reported (``startup_check``) for the daemon to log; a pack's magic is checked by ``verify``
and before each restore (``index.check_pack``). Every manifest is then read once (one read
each, on a few threads) and only *counted* by the key id it names (``manifest_census``,
nothing authenticated or trusted): how many this node can read, how many are signed with keys
it lacks, how many are unauthenticated (format 1). A daemon without a key file uses it to
refuse to create one for a store whose manifests were signed by another key.

Adoption signs every format-1 (unauthenticated) manifest that is intact and names the
checkpoint it is stored as, replacing it in place (a whole object: readers see the old or
the new one). It trusts the store as it is at that moment, so it is only ever done when an
operator asks for it (``adopt_unauthenticated``): never because a key file was created (a
mistyped key path must not sign a manifest someone planted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.core.ports import BlobStore
from ckptd.core.store.index import PageIndex
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import Manifest, is_legacy, signer
from ckptd.core.store.objects import MANIFEST_PREFIX
from ckptd.domain.model import is_checkpoint_id
from ckptd.errors import BlobNotFound, CorruptCheckpoint


@dataclass(frozen=True)
class StartupCheck:
    packs: int
    """Packs whose footer and trailer were read and found intact."""
    damaged: tuple[str, ...]
    """One line per damaged pack: its id and what is wrong."""

    def lines(self) -> list[str]:
        return [f"damaged store object: {what}" for what in self.damaged]

    def summary(self) -> str:
        return (f"store checked at start: {self.packs} pack(s) indexed (end marker, footer and "
                f"trailer checksum of each), {len(self.damaged)} damaged"
                + ("; run `ckptctl verify` for the checkpoints they hurt" if self.damaged
                   else ""))


def startup_check(index: PageIndex) -> StartupCheck:
    """What building ``index`` found (it has read every pack's footer and trailer)."""
    damaged = tuple(what if pack_id in what else f"pack {pack_id}: {what}"
                    for pack_id, what in sorted(index.damaged.items()))
    return StartupCheck(len(index.packs), damaged)


@dataclass(frozen=True)
class Adoption:
    adopted: tuple[str, ...] = ()
    """Checkpoints whose format-1 manifest was signed."""
    refused: tuple[str, ...] = ()
    """Why each other format-1 manifest was not (damaged, or names another checkpoint)."""


def adopt_unauthenticated(blobs: BlobStore, keys: ManifestKeys, store_id: str) -> Adoption:
    """Sign every intact format-1 manifest of the store in place (module docstring). Run with
    no dump or GC of this daemon in flight (the caller holds the store's exclusive lock)."""
    adopted: list[str] = []
    refused: list[str] = []
    for key, _mtime in list(blobs.list(MANIFEST_PREFIX)):
        cid = key[len(MANIFEST_PREFIX):]
        if not is_checkpoint_id(cid):
            continue
        try:
            data = blobs.get(key)
        except BlobNotFound:
            continue  # deleted meanwhile
        if not is_legacy(data):
            continue
        try:
            manifest = Manifest.from_legacy_bytes(data, cid)
        except CorruptCheckpoint as exc:
            refused.append(exc.message)
            continue
        blobs.put(key, manifest.to_bytes(keys, store_id))
        adopted.append(cid)
    blobs.flush()
    return Adoption(tuple(adopted), tuple(refused))


CENSUS_THREADS = 8
"""Manifests read at once by the census (object stores: one request each)."""
ADOPT_SETTING = "adopt_unauthenticated = true (--adopt-unauthenticated)"


@dataclass(frozen=True)
class ManifestCensus:
    """The store's manifests counted by the key id each names, none authenticated (a count,
    not a verdict: a manifest counted as held may still be refused when read)."""

    held: int
    """Format 2, naming a key this node holds."""
    foreign: tuple[tuple[str, int], ...]
    """(key id, count) of format-2 manifests naming a key this node lacks, most first."""
    legacy: int
    """Format 1 (unauthenticated, before ADR 0014): not listed or restored until adopted."""
    unreadable: int
    """Neither (damaged): named by ``verify``."""

    @property
    def foreign_count(self) -> int:
        return sum(n for _kid, n in self.foreign)

    def foreign_keys(self) -> str:
        """``N by key K, ...`` (at most 4 key ids)."""
        named = [f"{n} by key {kid}" for kid, n in self.foreign[:4]]
        more = len(self.foreign) - len(named)
        return ", ".join(named) + (f" and {more} other key(s)" if more else "")

    def summary(self) -> str:
        """The start-up line: how many manifests this node can and cannot read, and why."""
        line = (f"manifests in the store: {self.held} signed with a key this node holds, "
                f"{self.foreign_count} signed with keys this node lacks")
        if self.foreign:
            line += (f" ({self.foreign_keys()}: not listed or restored here; give this node "
                     "the key file of the nodes that wrote them, manifest_keys)")
        return line + f", {self.legacy} unauthenticated (format 1), {self.unreadable} damaged"

    def unadopted(self) -> str:
        """The start-up line when format-1 manifests are left as they are."""
        return (f"{self.legacy} unauthenticated manifest(s) (format 1: written before ckptd "
                "signed manifests, or planted) left unadopted: not listed or restored; if the "
                f"store was not tampered with, start once with {ADOPT_SETTING} to sign them")


def manifest_census(blobs: BlobStore, held: Collection[str]) -> ManifestCensus:
    """Read every manifest of ``blobs`` once and count it by the key id it names (``held``:
    the key ids this node holds). Trusts nothing it reads; a manifest deleted meanwhile is
    not counted."""
    keys = [key for key, _mtime in blobs.list(MANIFEST_PREFIX)
            if is_checkpoint_id(key[len(MANIFEST_PREFIX):])]

    def kind(key: str) -> str | None:
        try:
            data = blobs.get(key)
        except BlobNotFound:
            return None
        if is_legacy(data):
            return "legacy"
        return signer(data) or "unreadable"

    with ThreadPoolExecutor(CENSUS_THREADS, thread_name_prefix="census") as pool:
        counts = Counter(k for k in pool.map(kind, keys) if k is not None)
    legacy, unreadable = counts.pop("legacy", 0), counts.pop("unreadable", 0)
    return ManifestCensus(
        held=sum(n for kid, n in counts.items() if kid in held),
        foreign=tuple(sorted(((kid, n) for kid, n in counts.items() if kid not in held),
                             key=lambda kn: (-kn[1], kn[0]))),
        legacy=legacy,
        unreadable=unreadable,
    )
