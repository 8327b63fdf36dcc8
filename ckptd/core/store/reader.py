"""Reading a checkpoint back: every byte verified against its hash on the way out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ckptd.core.ports import BlobStore
from ckptd.core.store import pagelist
from ckptd.core.store.index import PageIndex, pack_key
from ckptd.core.store.manifest import FileEntry, Manifest
from ckptd.core.store.objects import get_blob
from ckptd.core.store.packs import read_frame
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_PAGE, ZERO_REF, PageHasher
from ckptd.errors import BlobNotFound, CorruptCheckpoint

CHUNK = 8 << 20


class CheckpointReader:
    """Streams the files of one checkpoint. Raises CorruptCheckpoint naming the checkpoint and
    the damaged object on any mismatch; yields nothing unverified."""

    def __init__(
        self,
        blobs: BlobStore,
        index: PageIndex,
        manifest: Manifest,
        hasher: PageHasher,
        cache_frames: int = 64,
    ) -> None:
        self._blobs = blobs
        self._index = index
        self._m = manifest
        self._hasher = hasher
        self._cache: OrderedDict[tuple[str, int], list[bytes]] = OrderedDict()
        self._cache_frames = cache_frames
        self._id = manifest.record.id

    def refs(self, entry: FileEntry) -> list[bytes]:
        data = get_blob(self._blobs, self._hasher, entry.pagelist, self._id)
        base: Sequence[bytes] | None = None
        if entry.pagelist_base:
            base_data = get_blob(self._blobs, self._hasher, entry.pagelist_base, self._id)
            base = pagelist.decode(base_data)
        try:
            return pagelist.decode(data, base)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page list of {entry.name} is damaged ({exc.message})",
                checkpoint_id=self._id,
            ) from exc

    def chunks(self, entry: FileEntry) -> Iterator[bytes]:
        """The file's content, in chunks of about CHUNK bytes."""
        if entry.blob:
            data = get_blob(self._blobs, self._hasher, entry.blob, self._id)
            if len(data) != entry.size:
                raise CorruptCheckpoint(
                    f"checkpoint {self._id}: {entry.name} has {len(data)} bytes, "
                    f"expected {entry.size}",
                    checkpoint_id=self._id,
                )
            yield data
            return
        refs = self.refs(entry)
        if len(refs) * PAGE_SIZE != entry.size:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page list of {entry.name} does not match its size",
                checkpoint_id=self._id,
            )
        buf: list[bytes] = []
        for ref in refs:
            buf.append(ZERO_PAGE if ref == ZERO_REF else self._page(ref))
            if len(buf) * PAGE_SIZE >= CHUNK:
                yield b"".join(buf)
                buf = []
        if buf:
            yield b"".join(buf)

    def _page(self, ref: bytes) -> bytes:
        loc = self._index.get(ref)
        if loc is None:
            self._index.refresh(self._blobs)
            loc = self._index.get(ref)
        if loc is None:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: page {ref.hex()} is in no pack (a pack is missing)",
                checkpoint_id=self._id,
            )
        key = (loc.pack_id, loc.frame)
        pages = self._cache.get(key)
        if pages is None:
            pages = self._load_frame(loc.pack_id, loc.frame)
            self._cache[key] = pages
            if len(self._cache) > self._cache_frames:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return pages[loc.index]

    def _load_frame(self, pack_id: str, frame_no: int) -> list[bytes]:
        pack = self._index.packs[pack_id]
        frame = pack.frames[frame_no]
        try:
            raw = self._blobs.get(pack_key(pack_id), frame.offset, frame.offset + frame.length)
        except BlobNotFound as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: pack {pack_id} is missing", checkpoint_id=self._id
            ) from exc
        try:
            return read_frame(pack_id, frame_no, raw, frame.hashes, self._hasher.digest)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"checkpoint {self._id}: {exc.message}", checkpoint_id=self._id
            ) from exc
