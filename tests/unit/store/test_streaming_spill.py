"""Issue 25, point 1: a streamed dump never waits for ingest. Chunks arriving while the
ingest pipeline is full go, as they are, to a spill file; ``finish`` (the commit, after the
tree is let go) ingests them in order. Bounded memory, every page stored exactly as sent."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptd.core.store import pagelist
from ckptd.core.store.index import PageIndex
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.core.store.reader import PageSource
from ckptd.core.store.streaming import SPILL_NAME, StreamedPages
from ckptd.errors import StoreError
from ckptd.testing import MemoryBlobStore

HASHER = PageHasher(b"k", 0)
CHUNK = 64 * PAGE_SIZE


def _image(seed: int, pages: int) -> bytes:
    """Random pages with runs of zero pages and a few repeated ones."""
    rng = random.Random(seed)
    out = []
    for i in range(pages):
        kind = rng.random()
        if kind < 0.2:
            out.append(bytes(PAGE_SIZE))
        elif kind < 0.3 and out:
            out.append(out[rng.randrange(len(out))])
        else:
            out.append(rng.randbytes(PAGE_SIZE - 8) + i.to_bytes(8, "little"))
    return b"".join(out)


class _HeldPuts:
    """Every pack put waits until ``release`` (ingest stalls, as on a slow disk)."""

    def __init__(self, blobs: MemoryBlobStore) -> None:
        self.released = threading.Event()
        blobs.on_put = self._hook

    def _hook(self, key: str) -> None:
        if key.startswith("packs/"):
            assert self.released.wait(60), "puts held for a minute"

    def release(self) -> None:
        self.released.set()


def _feed(sink: StreamedPages, images: dict[str, bytes]) -> float:
    """Send every image in chunks, the chunk buffer reused as the receiver does; the
    longest a single ``pages`` call took."""
    buf = bytearray(CHUNK)
    longest = 0.0
    for name, data in images.items():
        sink.begin_image(name)
        for at in range(0, len(data), CHUNK):
            part = data[at : at + CHUNK]
            buf[: len(part)] = part
            t0 = time.monotonic()
            sink.pages(name, at, memoryview(buf)[: len(part)])
            longest = max(longest, time.monotonic() - t0)
            buf[:] = bytes(CHUNK)  # the receiver reuses its buffer at once
        sink.end_image(name, len(data))
    return longest


def _read_back(blobs: MemoryBlobStore, index: PageIndex, pool: ThreadPoolExecutor,
               sink: StreamedPages, name: str, tmp_path: Path) -> bytes:
    refs = pagelist.Refs(sink.refs[name])
    out = tmp_path / f"rebuilt-{name}"
    PageSource(blobs, index, HASHER, pool, name).write_pages(refs, out, frozenset())
    return out.read_bytes()


def test_a_stalled_ingest_spills_and_the_sender_never_waits(tmp_path: Path) -> None:
    """Pack writes held: without a spill the sink would wait at its bound on the first
    pack; with one, every ``pages`` call returns at once (the rest goes to the spill file
    in the spill directory), and ``finish`` once puts go on stores every page exactly, and
    removes the spill and the directory it made."""
    images = {"pages-1.img": _image(1, 4500), "pages-2.img": _image(2, 2100)}
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    spill_dir = tmp_path / "staging" / "ck-1"
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=2,
                             max_packs=1, spill_dir=spill_dir)
        longest = _feed(sink, images)
        assert longest < 10, f"a pages call waited {longest:.1f}s for ingest"
        spill = spill_dir / SPILL_NAME
        assert spill.is_file() and spill.stat().st_size > len(images["pages-2.img"])
        assert not any(k.startswith("packs/") for k in blobs.puts)
        spilled = spill.stat().st_size
        held.release()
        sink.finish()
        assert not spill_dir.exists()
        assert sink.spilled == spilled
        for name, data in images.items():
            assert sink.sizes[name] == len(data)
            assert len(sink.refs[name]) == len(data) // PAGE_SIZE * 16
            assert _read_back(blobs, index, pool, sink, name, tmp_path) == data, name
        zero = bytes(PAGE_SIZE)
        assert pagelist.Refs(sink.refs["pages-1.img"])[
            images["pages-1.img"].index(zero) // PAGE_SIZE] == ZERO_REF


def test_without_a_spill_directory_ingest_waits(tmp_path: Path) -> None:
    """The bound without a spill: the sender is held (here until the puts are released)."""
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    timer = threading.Timer(1.5, held.release)
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=2,
                             max_packs=1)
        timer.start()
        longest = _feed(sink, {"pages-1.img": _image(3, 3500)})
        sink.finish()
    timer.join()
    assert longest >= 1.0
    assert not list(tmp_path.iterdir())


def test_a_discarded_dump_removes_its_spill(tmp_path: Path) -> None:
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    spill_dir = tmp_path / "ck-2"
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=1,
                             max_packs=1, spill_dir=spill_dir)
        _feed(sink, {"pages-1.img": _image(4, 2600)})
        assert (spill_dir / SPILL_NAME).exists()
        sink.discard()
        assert not spill_dir.exists()
        held.release()


def test_a_spill_that_cannot_be_read_back_fails_the_commit_in_one_line(tmp_path: Path) -> None:
    """A spill cut short (a disk error, someone truncating it): ``finish`` raises
    ``StoreError`` naming it, never stores short pages; the spill is removed."""
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    spill_dir = tmp_path / "ck-3"
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=1,
                             max_packs=1, spill_dir=spill_dir)
        _feed(sink, {"pages-1.img": _image(5, 2600)})
        spill = spill_dir / SPILL_NAME
        os.truncate(spill, spill.stat().st_size - PAGE_SIZE)
        held.release()
        with pytest.raises(StoreError, match="spilled during the dump cannot be read back"):
            sink.finish()
        assert not spill_dir.exists()


def _memfds() -> list[int]:
    """The spill memfds open in this process (inode numbers: mmap holds a dup of each)."""
    found = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:ckptd-spill"):
                found.add(os.stat(fd).st_ino)
        except OSError:
            continue
    return sorted(found)


@pytest.mark.parametrize("ram_pages", [10_000, 1500, 0])
def test_the_spill_goes_to_ram_up_to_its_budget_then_to_the_file(
    tmp_path: Path, ram_pages: int
) -> None:
    """Issue 35: a spill within ``spill_ram`` is held in an anonymous memfd (no file, no
    directory made); past it, the rest (in order) goes to the file. Either way every page is
    stored exactly and nothing is left: no memfd, no file, no directory."""
    images = {"pages-1.img": _image(6, 2600), "pages-2.img": _image(7, 900)}
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    spill_dir = tmp_path / "ck-4"
    before = _memfds()
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=1,
                             max_packs=1, spill_dir=spill_dir, spill_ram=ram_pages * PAGE_SIZE)
        _feed(sink, images)
        spill_file = spill_dir / SPILL_NAME
        everything = sum(map(len, images.values()))
        if ram_pages == 10_000:  # all of it fits
            assert not spill_dir.exists()
            assert len(_memfds()) == len(before) + 1
        elif ram_pages:
            assert len(_memfds()) == len(before) + 1
            assert 0 < spill_file.stat().st_size < everything - ram_pages * PAGE_SIZE + CHUNK
        else:
            assert _memfds() == before
            assert spill_file.is_file()
        held.release()
        sink.finish()
        assert sink.spilled_ram <= ram_pages * PAGE_SIZE
        assert sink.spilled_ram > 0 or ram_pages == 0
        assert not spill_dir.exists()
        assert _memfds() == before
        for name, data in images.items():
            assert _read_back(blobs, index, pool, sink, name, tmp_path) == data, name
        assert "MiB of it in RAM" in sink.profile()


def test_a_file_of_the_spill_s_name_it_did_not_make_is_left_alone(tmp_path: Path) -> None:
    """A spill held in RAM never removes a file it did not make (only its own, O_EXCL)."""
    spill_dir = tmp_path / "ck-5"
    spill_dir.mkdir()
    planted = spill_dir / SPILL_NAME
    planted.write_bytes(b"someone else's")
    blobs, index = MemoryBlobStore(), PageIndex()
    held = _HeldPuts(blobs)
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=HASHER, executor=pool,
                             writer=writer, pack_bytes=32 * PAGE_SIZE, max_frames=1,
                             max_packs=1, spill_dir=spill_dir, spill_ram=64 << 20)
        _feed(sink, {"pages-1.img": _image(8, 1200)})
        held.release()
        sink.finish()
    assert planted.read_bytes() == b"someone else's"
