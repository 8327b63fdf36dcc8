"""What a lazy restore reads from disk (``lazypages``): CRIU's pagemap images, and the images
staged for ``criu restore --lazy-pages``.

- ``parse_pagemap``: a ``pagemap-*.img`` as columns (``array``s: a few bytes an entry, no
  object per entry), natively (``ckptd._pages.pagemap_columns``) or in Python where the
  module is not built; ``Pagemap.locate`` finds the entry holding an address.
- ``stage``: every image but the pages written to the restore's directory; each pages image a
  sparse file of its full size holding only the pages CRIU's restore reads itself (entries
  without ``PE_LAZY``: stacks, file mappings' private pages, shared memory).
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptd.adapters.criu.images import IMG_COMMON_MAGIC, is_pages_image, proto_fields
from ckptd.adapters.criu.pageserver import PAGE_SIZE, PAGEMAP_MAGIC, PE_LAZY, PE_PARENT, PE_PRESENT
from ckptd.core.ports import ImageSource
from ckptd.errors import CorruptCheckpoint

try:
    from ckptd._pages import pagemap_columns as _native_columns
except ImportError:  # not built (no compiler at install time): the Python reader
    _native_columns = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Entry:
    """One pagemap entry: ``nr_pages`` pages from ``vaddr``; ``first``: the index of its
    first page in the pages image (entries without data take none)."""

    vaddr: int
    nr_pages: int
    flags: int
    first: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE

    @property
    def has_data(self) -> bool:
        return bool(self.flags & PE_PRESENT)

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)


class Pagemap:
    """A pagemap image: its pages image and entries (by address, as CRIU writes them),
    held as columns (``array``: a few bytes an entry, no object per entry)."""

    def __init__(self, pages_name: str, starts: array[int], counts: array[int],
                 flags: array[int], firsts: array[int]) -> None:
        self.pages_name = pages_name
        self.starts, self.counts, self.flags, self.firsts = starts, counts, flags, firsts

    def __len__(self) -> int:
        return len(self.starts)

    def entry(self, i: int) -> Entry:
        return Entry(self.starts[i], self.counts[i], self.flags[i], self.firsts[i])

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(self.entry(i) for i in range(len(self)))

    def eager(self) -> Iterator[Entry]:
        """The entries with data that CRIU's restore reads itself (not ``PE_LAZY``)."""
        for i, flags in enumerate(self.flags):
            if flags & PE_PRESENT and not flags & PE_LAZY and self.counts[i]:
                yield self.entry(i)

    def locate(self, vaddr: int) -> Entry | None:
        """The entry with data that holds the page at ``vaddr``, if any."""
        i = bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return None
        entry = self.entry(i)
        return entry if entry.has_data and vaddr < entry.end else None


def parse_pagemap(raw: bytes, name: str) -> Pagemap:
    """``pagemap-*.img`` read: its head (``pages_id``) and entries (natively when
    ``ckptd._pages`` is built: a few ms for a million entries). ValueError if it is not
    one."""
    if len(raw) < 8 or struct.unpack_from("<II", raw, 0) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise ValueError(f"{name} is not a pagemap image")
    try:
        reader = _python_columns if _native_columns is None else _native_columns
        pages_id, *columns = reader(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    arrays = [array(code) for code in ("Q", "Q", "I", "Q")]
    for column, data in zip(arrays, columns, strict=True):
        column.frombytes(data)
    return Pagemap(f"pages-{pages_id}.img", *arrays)


def _python_columns(raw: bytes) -> tuple[int, bytes, bytes, bytes, bytes]:
    """``_pages.pagemap_columns`` in Python (a node without the native module)."""
    messages: list[bytes] = []
    offset = 8
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ValueError("an entry cut short")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise ValueError("an entry cut short")
        messages.append(raw[offset:offset + size])
        offset += size
    if not messages:
        raise ValueError("no head")
    pages_id = _int(dict(proto_fields(messages[0])), 1)
    if pages_id is None:
        raise ValueError("no pages_id")
    columns = [array(code) for code in ("Q", "Q", "I", "Q")]
    first = 0
    for message in messages[1:]:
        fields = dict(proto_fields(message))
        vaddr = _int(fields, 1)
        count = _int(fields, 5)
        if count is None:
            count = _int(fields, 2)
        flags = _int(fields, 4)
        if flags is None:
            flags = PE_PARENT if _int(fields, 3) else PE_PRESENT
        if vaddr is None or count is None:
            raise ValueError("an entry without vaddr or nr_pages")
        for column, value in zip(columns, (vaddr, count, flags, first), strict=True):
            column.append(value)
        if flags & PE_PRESENT:
            first += count
    vaddrs, counts, flag_column, firsts = (c.tobytes() for c in columns)
    return pages_id, vaddrs, counts, flag_column, firsts


def _int(fields: dict[int, int | bytes], number: int) -> int | None:
    value = fields.get(number)
    return value if isinstance(value, int) else None


def pagemap_id(name: str) -> int | None:
    """The task image id of ``pagemap-<id>.img`` (what the lazy daemon asks by); None for a
    shared-memory pagemap or another image."""
    if not (name.startswith("pagemap-") and name.endswith(".img")):
        return None
    middle = name[len("pagemap-"):-len(".img")]
    return int(middle) if middle.isdigit() else None


def stage(images: ImageSource, images_dir: Path) -> dict[int, Pagemap]:
    """Write what a lazy restore reads from ``images_dir``: every image but the pages, and
    each pages image as a sparse file holding only the pages CRIU's restore reads itself
    (those of entries without ``PE_LAZY``). Returns each task's pagemap by image id."""
    names = images.names()
    for name in names:  # (captured files' images may be there already)
        if not is_pages_image(name) and not (images_dir / name).exists():
            images.write(name, images_dir / name)
    task_maps: dict[int, Pagemap] = {}
    sized: set[str] = set()
    for name in names:
        if not name.startswith("pagemap-"):
            continue
        try:
            pagemap = parse_pagemap((images_dir / name).read_bytes(), name)
        except ValueError as exc:
            raise CorruptCheckpoint(f"checkpoint {images.checkpoint_id}: {exc}",
                                    checkpoint_id=images.checkpoint_id) from exc
        _write_eager_pages(images, images_dir, pagemap)
        sized.add(pagemap.pages_name)
        if (image_id := pagemap_id(name)) is not None:
            task_maps[image_id] = pagemap
    for name in names:  # a pages image no pagemap names: none in a CRIU dump; kept whole
        if is_pages_image(name) and name not in sized:
            images.write(name, images_dir / name)
    return task_maps


def _write_eager_pages(images: ImageSource, images_dir: Path, pagemap: Pagemap) -> None:
    name = pagemap.pages_name
    fd = os.open(images_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, images.size(name) if images.exists(name) else 0)
        for entry in pagemap.eager():
            data = images.pages(name, entry.first, entry.nr_pages)
            os.pwrite(fd, data, entry.first * PAGE_SIZE)
    finally:
        os.close(fd)
