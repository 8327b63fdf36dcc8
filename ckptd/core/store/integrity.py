"""What a daemon checks of its store when it starts, and the one-time adoption of manifests
written before they were authenticated (docs/adr/0014-authenticated-manifests.md).

At start, building the page index reads every pack's footer (end marker, where its trailer
is) and trailer (checksum, frames) — two ranged reads a pack, nothing else: a big store
starts as fast as before. What that finds damaged is reported (``startup_check``) for the
daemon to log; manifests are not read at start, and a pack's magic is checked by ``verify``
and before each restore (``index.check_pack``).

Adoption signs every format-1 (unauthenticated) manifest that is intact and names the
checkpoint it is stored as, replacing it in place (a whole object: readers see the old or
the new one). It trusts the store as it is at that moment: the daemon runs it when it creates
its manifest key (the upgrade), or when an operator asks for it (``adopt_unauthenticated``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.core.ports import BlobStore
from ckptd.core.store.index import PageIndex
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import Manifest, is_legacy
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
