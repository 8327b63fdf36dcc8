"""``MemoryPageExchange``: the page-level side of a store a migration needs (``PageExchange``),
in memory."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard

from ckptd.core.ports import ExportedImage, FrameKeeper, PageFrame
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.domain import CheckpointRecord
from ckptd.errors import CheckpointNotFound, PeerError


def _is_pages(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


@dataclass
class _Checkpoint:
    uid: int
    images: dict[str, bytes]


class MemoryPageExchange:
    """``PageExchange`` over checkpoints added whole (``add``), their pages held by reference
    in each uid's hash space (a secret of its own: ``store_id`` and ``page_seed`` differ from
    any other instance's). ``export`` sends one raw frame per wanted page; non-page images
    as one zstd frame each; ``frame_keeper`` keeps nothing (None). ``is_pages`` tells a pages
    image by its name (CRIU's ``pages-N.img`` by default)."""

    def __init__(self, is_pages: Callable[[str], bool] = _is_pages) -> None:
        self._secret = secrets.token_bytes(32)
        self._is_pages = is_pages
        self._pages: dict[bytes, bytes] = {}
        self._checkpoints: dict[str, _Checkpoint] = {}

    @property
    def store_id(self) -> str:
        return hashlib.sha256(b"memory-pages\0" + self._secret).hexdigest()[:32]

    def page_seed(self, uid: int) -> int:
        return PageHasher(self._secret, uid).seed

    def add(self, record: CheckpointRecord, images: Mapping[str, bytes]) -> None:
        """``record`` committed with these images (pages images: whole pages)."""
        hasher = PageHasher(self._secret, record.uid)
        for name, data in images.items():
            if self._is_pages(name):
                for page in _pages_of(name, data):
                    ref = hasher.page_ref(page)
                    if ref != ZERO_REF:
                        self._pages[ref] = page
        self._checkpoints[record.id] = _Checkpoint(record.uid, dict(images))

    def lacks(self, uid: int, refs: Sequence[bytes]) -> builtins.list[int]:
        del uid  # references are in the uid's hash space already
        return [i for i, r in enumerate(refs) if r != ZERO_REF and r not in self._pages]

    def fill_pages(
        self, uid: int, path: Path, refs: Sequence[bytes], skip: frozenset[int]
    ) -> None:
        del uid
        with open(path, "wb") as out:
            out.truncate(len(refs) * PAGE_SIZE)
            for i, ref in enumerate(refs):
                page = self._pages.get(ref)
                if i in skip or ref == ZERO_REF or page is None:
                    continue
                out.seek(i * PAGE_SIZE)
                out.write(page)

    @contextlib.contextmanager
    def checkout(self, checkpoint_id: str) -> Iterator[Path]:
        checkpoint = self._get(checkpoint_id)
        root = Path(tempfile.mkdtemp(prefix=f"checkout-{checkpoint_id}-"))
        try:
            for name, data in checkpoint.images.items():
                (root / name).write_bytes(data)
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)

    @contextlib.contextmanager
    def export(self, checkpoint_id: str, seed: int) -> Iterator[_Export]:
        yield _Export(checkpoint_id, self._get(checkpoint_id), PageHasher.from_seed(seed),
                      self._is_pages)

    def frame_keeper(self, checkpoint_id: str, uid: int) -> FrameKeeper | None:
        del checkpoint_id, uid
        return None

    def _get(self, checkpoint_id: str) -> _Checkpoint:
        checkpoint = self._checkpoints.get(checkpoint_id)
        if checkpoint is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id}",
                                     checkpoint_id=checkpoint_id)
        return checkpoint


class _Export:
    """``CheckpointExport`` of one checkpoint for the hash space of ``theirs``."""

    def __init__(self, checkpoint_id: str, checkpoint: _Checkpoint, theirs: PageHasher,
                 is_pages: Callable[[str], bool]) -> None:
        self._id = checkpoint_id
        self._pages: dict[str, builtins.list[bytes]] = {}
        images: list[ExportedImage] = []
        for name, data in checkpoint.images.items():
            if not is_pages(name):
                images.append(ExportedImage(
                    name, len(data), data=zstandard.ZstdCompressor().compress(data)))
                continue
            pages = self._pages[name] = _pages_of(name, data)
            refs = [theirs.page_ref(p) for p in pages]
            images.append(ExportedImage(name, len(data), refs=b"".join(refs),
                                        pages=len(refs) - refs.count(ZERO_REF)))
        self.images: Sequence[ExportedImage] = images

    def frames(self, wanted: Mapping[str, Sequence[int]]) -> Iterator[PageFrame]:
        for name, indices in wanted.items():
            pages = self._pages.get(name, [])
            for i in indices:
                if not 0 <= i < len(pages):
                    raise PeerError(f"the target asked for page {i} of {name}, which has "
                                    f"{len(pages)}", checkpoint_id=self._id)
                yield PageFrame(pages[i], 1, ((name, i, 0, 1),), raw=True)


def _pages_of(name: str, data: bytes) -> builtins.list[bytes]:
    if len(data) % PAGE_SIZE:
        raise ValueError(f"pages image {name} is not whole pages ({len(data)} bytes)")
    return [data[i : i + PAGE_SIZE] for i in range(0, len(data), PAGE_SIZE)]

