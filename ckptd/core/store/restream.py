"""Images for a streamed restore (the ``ImageSource`` port): read as they are asked for.

``CheckpointImages`` reads a checkpoint's images from the store, each byte verified before it
is handed out (``CheckpointReader.stream``); ``DirectoryImages`` reads an image directory as
it is (a migration's staged images, tests). Neither knows how the images reach CRIU: that is
the CRIU adapter's protocol (``adapters/criu/imgstreamer.py``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

from ckptd.core.store.manifest import Manifest
from ckptd.core.store.pagehash import PAGE_SIZE
from ckptd.core.store.reader import PREFETCH, CheckpointReader, Segment

CHUNK = 1 << 20
FRAME_BUDGET = 64
"""Frames (4 MiB each, decompressed) the open pages images of one restore hold together."""


class CheckpointImages:
    """The images of one checkpoint's manifest, from the store. Every chunk is verified (a
    frame is verified whole before any of its pages is yielded; an image stored whole is
    verified whole); a damaged or missing object raises CorruptCheckpoint naming the
    checkpoint and the object.

    From the start a thread plans each pages image (its page list read, every page located),
    so that CRIU, asking for one, does not wait for that: it overlaps the rest of the
    restore's preparation. A plan's failure is raised when its image is read.

    Memory: the pages images read at once (a tree's processes restore in parallel) share
    FRAME_BUDGET frames: each holds at most ``min(PREFETCH, FRAME_BUDGET // open)`` ahead and
    at least one, plus the frame it is handing out; so about FRAME_BUDGET * 4 MiB (256 MiB)
    up to FRAME_BUDGET / 2 images open at once, two frames per image beyond."""

    def __init__(self, reader: CheckpointReader, manifest: Manifest, *,
                 plan_ahead: bool = True) -> None:
        self.checkpoint_id = manifest.record.id
        self._reader = reader
        self._entries = {f.name: f for f in manifest.files}
        self._plans: dict[str, Future[tuple[list[Segment], int]]] = {
            f.name: Future() for f in sorted(manifest.files, key=lambda f: f.name)
            if f.pagelist and plan_ahead
        }
        """Each pages image's plan, made by a thread from the start; none without
        ``plan_ahead`` (an image streamed then plans itself)."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open = 0
        self._random: dict[str, RandomPages] = {}
        if plan_ahead:  # (a lazy restore reads few pages at a time: no plan needed)
            threading.Thread(target=self._plan_all, name=f"plan {self.checkpoint_id}",
                             daemon=True).start()

    def _plan_all(self) -> None:
        for name, future in self._plans.items():
            if self._closed.is_set() or not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._reader.stream_plan(self._entries[name]))
            except BaseException as exc:  # raised to whoever reads the image
                future.set_exception(exc)

    def close(self) -> None:
        """Stop planning (the images will not be read any more)."""
        self._closed.set()
        for future in self._plans.values():
            future.cancel()

    def exists(self, name: str) -> bool:
        return name in self._entries

    def size(self, name: str) -> int:
        return self._entries[name].size

    def chunks(self, name: str) -> Iterator[memoryview]:
        entry = self._entries[name]
        future = self._plans.get(name)
        if future is None:
            return self._reader.stream(entry)
        plan = None if future.cancelled() else future.result()
        return self._budgeted(self._reader.stream(entry, plan, self._window))

    def _window(self) -> int:
        """Frames each open pages image may hold ahead: FRAME_BUDGET shared out (never
        waiting for another image: CRIU's tasks read theirs independently)."""
        with self._lock:
            return max(1, min(PREFETCH, FRAME_BUDGET // max(1, self._open)))

    def _budgeted(self, chunks: Iterator[memoryview]) -> Iterator[memoryview]:
        with self._lock:
            self._open += 1
        try:
            yield from chunks
        finally:
            with self._lock:
                self._open -= 1

    def write(self, name: str, path: Path) -> None:
        self._reader.materialize(self._entries[name], path)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def pages(self, name: str, first: int, count: int) -> bytes | memoryview:
        with self._lock:
            pages = self._random.get(name)
        if pages is None:
            entry = self._entries.get(name)
            if entry is None or not entry.pagelist:
                raise KeyError(f"{name} is not a pages image")
            pages = RandomPages(self._reader, self._reader.packed_refs(entry))
            with self._lock:
                pages = self._random.setdefault(name, pages)
        return pages.read(first, count)


class RandomPages:
    """One pages image read at any page (a lazy restore): the image's page list held packed
    (16 bytes a page), each read located on its own (``frame_runs``: no plan of the whole
    image, which takes a second for a few GiB), the frames it needs verified whole before any
    byte of them is returned, and the last FRAMES_KEPT kept, since the pages asked for next
    are mostly their neighbours. Thread-safe (one lock: a lazy restore serves its pages from
    one thread)."""

    FRAMES_KEPT = 8
    """Verified frames kept (4 MiB each, decompressed)."""

    def __init__(self, reader: CheckpointReader, refs: Sequence[bytes]) -> None:
        self._reader = reader
        self._refs = refs
        self._frames: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, first: int, count: int) -> bytes | memoryview:
        """The pages; a view into a verified frame when one run of one frame holds them all
        (then no copy)."""
        if first < 0 or count < 0 or first + count > len(self._refs):
            raise IndexError(f"pages {first}+{count} of an image of {len(self._refs)}")
        with self._lock:
            runs = self._reader.frame_runs(self._refs[first:first + count])
            if len(runs) == 1:
                ((key, (only, *more)),) = runs.items()
                at, in_frame, n = only
                if not more and at == 0 and n == count:
                    src = in_frame * PAGE_SIZE
                    return memoryview(self._frame(key))[src:src + count * PAGE_SIZE]
            out = bytearray(count * PAGE_SIZE)  # zero pages: the gaps between runs
            for key, frame_runs in runs.items():
                frame = memoryview(self._frame(key))
                for at, in_frame, n in frame_runs:
                    out[at * PAGE_SIZE:(at + n) * PAGE_SIZE] = \
                        frame[in_frame * PAGE_SIZE:(in_frame + n) * PAGE_SIZE]
            return memoryview(out)

    def _frame(self, key: tuple[str, int]) -> bytes:
        data = self._frames.get(key)
        if data is not None:
            self._frames.move_to_end(key)
            return data
        data = self._reader.load_frame(*key)
        self._frames[key] = data
        if len(self._frames) > self.FRAMES_KEPT:
            self._frames.popitem(last=False)
        return data


class DirectoryImages:
    """The images of a directory, read as they are (nothing to verify)."""

    def __init__(self, directory: Path, checkpoint_id: str = "") -> None:
        self.checkpoint_id = checkpoint_id or directory.name
        self._dir = directory

    def exists(self, name: str) -> bool:
        return "/" not in name and (self._dir / name).is_file()

    def size(self, name: str) -> int:
        if not self.exists(name):
            raise KeyError(name)
        return (self._dir / name).stat().st_size

    def chunks(self, name: str) -> Iterator[memoryview]:
        if not self.exists(name):
            raise KeyError(name)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        fd = os.open(self._dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while n := os.readv(fd, [buf]):
                yield view[:n]
        finally:
            os.close(fd)

    def write(self, name: str, path: Path) -> None:
        with open(path, "xb") as out:
            for chunk in self.chunks(name):
                out.write(chunk)

    def names(self) -> list[str]:
        return sorted(p.name for p in self._dir.iterdir() if p.is_file())

    def pages(self, name: str, first: int, count: int) -> bytes | memoryview:
        if first < 0 or count < 0 or (first + count) * PAGE_SIZE > self.size(name):
            raise IndexError(f"pages {first}+{count} of {name}")
        fd = os.open(self._dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, count * PAGE_SIZE, first * PAGE_SIZE)
        finally:
            os.close(fd)
