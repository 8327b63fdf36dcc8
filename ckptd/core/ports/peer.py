"""The migration ports: pages exchanged in a target's hash space, links to peers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckptd.domain import CheckpointRecord, PeerProbe, ReceivedState, RemoteRestore

PlaceRun = tuple[str, int, int, int]
"""Where pages of a frame go: (image, first page in the image, first page in the frame,
count)."""


@dataclass(frozen=True)
class PageFrame:
    """Pages on the wire: ``data`` holds ``pages`` pages, a zstd frame or (``raw``) the pages
    as they are (then exactly ``pages * PAGE_SIZE`` bytes); ``runs`` say where they go. A
    frame the source's store holds is sent as it is (no recompression) when every one of its
    pages is wanted; each page is verified against the reference offered for each of its
    places before it is written there."""

    data: bytes
    pages: int
    runs: tuple[PlaceRun, ...]
    raw: bool = False

    @property
    def places(self) -> int:
        """How many page places the frame fills (a page may fill several)."""
        return sum(run[3] for run in self.runs)


@dataclass(frozen=True)
class ExportedImage:
    """One image of a checkpoint as a migration sends it. A pages image: ``refs``, every
    page's reference in the *target's* hash space (ZERO_REF for a zero page), ``pages`` of
    them not zero. Any other image: ``data``, its content as a zstd frame (as the store
    keeps it)."""

    name: str
    size: int
    refs: bytes | None = None
    pages: int = 0
    data: bytes = b""


class CheckpointExport(Protocol):
    """A committed checkpoint read from the store for another store's hash space
    (``PageExchange.export``): every page verified against this store's hash as it is read."""

    images: Sequence[ExportedImage]

    def frames(self, wanted: Mapping[str, Sequence[int]]) -> Iterator[PageFrame]:
        """Frames carrying every page place of ``wanted`` (image -> sorted page indices):
        stored frames as they are when all their pages are wanted, else frames of just the
        wanted pages. Read ahead on the store's executor."""
        ...


class FrameKeeper(Protocol):
    """Received frames kept as they are for the commit of one begun checkpoint
    (``PageExchange.frame_keeper``)."""

    def keep(self, frame: PageFrame, hashes: Sequence[bytes]) -> bool:
        """Keep ``frame`` (its pages verified: ``hashes``, in frame order) for the commit,
        which puts it in a pack as it is; False (nothing kept) when any of its pages is
        in the store or kept already, or it cannot be kept."""
        ...


class PageExchange(Protocol):
    """The page-level side of a store that a migration needs (both ends): the content store
    (``ckptd.core.store.ContentStore``) and ``ckptd.testing.MemoryPageExchange`` pass the same
    contract suite (tests/contract/test_page_exchange_contract.py).

    A page reference is the store's keyed hash of a page for one uid (``ZERO_REF`` for a page
    of zeros). Two daemons compare pages in the *target's* hash space: the target tells its
    seed for the uid (``page_seed``), the source hashes its pages with it."""

    @property
    def store_id(self) -> str:
        """Equal on two daemons iff they use one store (a hash of its secret, never the
        secret)."""
        ...

    def page_seed(self, uid: int) -> int: ...

    def lacks(self, uid: int, refs: Sequence[bytes]) -> list[int]:
        """Indices of ``refs`` (non-zero) whose pages the store does not hold (or holds only
        in condemned packs)."""
        ...

    def fill_pages(
        self, uid: int, path: Path, refs: Sequence[bytes], skip: frozenset[int]
    ) -> None:
        """Write at ``path`` (created, ``len(refs)`` pages, sparse) every page of ``refs`` held
        by the store except those at indices ``skip`` (written by someone else), verified."""
        ...

    def checkout(self, checkpoint_id: str) -> AbstractContextManager[Path]:
        """CRIU's image directory of a committed checkpoint, verified, removed on exit."""
        ...

    def export(self, checkpoint_id: str, seed: int) -> AbstractContextManager[CheckpointExport]:
        """A committed checkpoint's images, pages hashed with ``seed`` (another store's hash
        space), without materializing them; the store's GC waits until it closes."""
        ...

    def frame_keeper(self, checkpoint_id: str, uid: int) -> FrameKeeper | None:
        """Where the receiver of the begun ``checkpoint_id`` keeps frames for its commit;
        None when it keeps none."""
        ...


class PeerSession(Protocol):
    """One transfer to a target daemon (``PeerLink.open``)."""

    page_seed: int

    def offer_pages(self, name: str, size: int, refs: bytes, first: int = 0) -> list[int]:
        """Offer pages ``first ..`` of image ``name`` (``size`` bytes in all) by reference;
        the indices of those the target lacks. Slices go in order, from page 0."""
        ...

    def offer_file(self, name: str, data: bytes, size: int | None = None) -> None:
        """Image ``name`` whole: ``data`` is its content, or with ``size`` a zstd frame of
        its ``size`` bytes."""
        ...

    def send(self, frames: Iterator[PageFrame]) -> int:
        """Send the frames; returns the page places the target filled."""
        ...

    def finish(self, output_path: str) -> RemoteRestore:
        """The target commits the checkpoint and restores it."""
        ...

    def abort(self) -> None: ...


class PeerLink(Protocol):
    """A connection to another node's daemon (its Peer service). Errors: ``PeerError`` when it
    cannot be reached or fails; the target's own refusals as the matching ckptd errors."""

    address: str

    def probe(self, record: CheckpointRecord) -> PeerProbe: ...

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> PeerSession: ...

    def received(self, checkpoint_id: str) -> ReceivedState:
        """What the target did with ``checkpoint_id``, from its durable records (the source
        of a migration whose link broke during ``finish`` asks); an answer neither restored
        nor restoring fences it there: the target never restores it afterwards."""
        ...

    def close(self) -> None: ...


class PeerConnector(Protocol):
    def connect(self, address: str) -> PeerLink:
        """A link to the daemon at ``host:port`` (mutual TLS); raises PeerError when TCP
        migration is not configured here."""
        ...
