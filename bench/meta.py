"""Per-page metadata of a dump: peak anonymous RSS growth of a streamed dump (StreamedPages
fed N MiB of distinct random pages in 4 MiB chunks, then ``ingest(streamed=...)`` and the
commit's packs and footprint) and of a staged one (one pages image of N MiB on disk, mapped:
its page cache is file RSS, not counted). Packs are compressed but not written (NullBlobs):
page data is bounded either way, what grows with the image is metadata (issue #13).

RssAnon is sampled every 5 ms (VmHWM would count the staged image's mapping).
Usage: .venv/bin/python -m bench meta [--mib 4096] [--mode stream|staged]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.report import Col, Report
from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.core.store import cas, pagelist
from ckptd.core.store.index import PageIndex
from ckptd.core.store.ingest import ingest
from ckptd.core.store.pagehash import PageHasher
from ckptd.core.store.streaming import StreamedPages

CHUNK = 4 << 20


class NullBlobs(LocalBlobStore):
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        return True

    def put_parts(self, key: str, parts: Any, *, if_absent: bool = False) -> bool:
        return True

    def flush(self) -> None:
        pass


def rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class Peak:
    def __init__(self) -> None:
        self.base = rss_anon_kib()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_anon_kib())

    def mib(self) -> float:
        self.peak = max(self.peak, rss_anon_kib())
        return (self.peak - self.base) / 1024

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def index_bytes(index: PageIndex) -> int:
    """The page index's own memory, estimated: its dict, a code (int) and a hash (bytes)
    per page, the frames' tuples of hashes."""
    pages = index._tables[0]
    tuples = sum(sys.getsizeof(f.hashes) for p in index.packs.values() for f in p.frames)
    return sys.getsizeof(pages) + len(pages) * (32 + 56) + tuples


def fill(buf: bytearray, i: int) -> None:
    for p in range(0, CHUNK, 4096):  # distinct pages in every chunk
        buf[p : p + 8] = (i * 1024 + p).to_bytes(8, "little")


def footprint(store_index: PageIndex, blobs: NullBlobs, result: Any) -> tuple[list[str], int]:
    fake = cas.ContentStore.__new__(cas.ContentStore)
    fake.index = store_index
    fake._blobs = blobs
    return fake._packs_and_footprint(result.pages if hasattr(result, "pages") else result.refs,
                                     set())


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=4096)
    ap.add_argument("--mode", choices=("stream", "staged"), default="stream")
    ap.add_argument("--known", action="store_true",
                    help="the pages are in the store already (a second dump of them)")
    ap.add_argument("--parent", action="store_true",
                    help="--known, and the first dump is the parent: page lists as deltas")


def run(args: argparse.Namespace, report: Report) -> int:
    args.known |= args.parent
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="bench-meta-"))
    images = root / "images"
    images.mkdir()
    rows = []
    try:
        buf = bytearray(os.urandom(CHUNK))
        if args.mode == "staged":
            with open(images / "pages-1.img", "wb") as fh:
                for i in range(args.mib // 4):
                    fill(buf, i)
                    fh.write(buf)
        index = PageIndex()
        blobs = NullBlobs(root / "blobs")
        hasher = PageHasher(b"k", 0)
        with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
            if args.known:  # a first dump of the same pages, not measured
                first = StreamedPages(blobs=blobs, index=index, hasher=hasher, executor=pool,
                                      writer=writer)
                first.begin_image("pages-1.img")
                for i in range(args.mib // 4):
                    fill(buf, i)
                    first.pages("pages-1.img", i * CHUNK, memoryview(buf))
                first.finish()
                parent = pagelist.encode_full(first.refs["pages-1.img"])
                del first
            base_for: Any = lambda _n: None  # noqa: E731
            if args.parent:  # as ContentStore._bases_from: the parent's list decoded at ingest
                packed = hasattr(pagelist, "decode_full_packed")

                def base_for(_name: str) -> Any:
                    if packed:
                        return "ab" * 16, pagelist.decode_full_packed(parent)
                    return "ab" * 16, pagelist.decode(parent)
            index_before = index_bytes(index)
            gc.collect()
            peak = Peak()
            t0 = time.monotonic()
            streamed = None
            if args.mode == "stream":
                streamed = StreamedPages(blobs=blobs, index=index, hasher=hasher,
                                         executor=pool, writer=writer)
                streamed.begin_image("pages-1.img")
                for i in range(args.mib // 4):
                    fill(buf, i)
                    streamed.pages("pages-1.img", i * CHUNK, memoryview(buf))
                streamed.end_image("pages-1.img", args.mib << 20)
                streamed.finish()
                rows.append(("pages streamed", peak.mib()))
            result = ingest(images, blobs=blobs, index=index, hasher=hasher,
                            is_pages_file=lambda n: n.startswith("pages-"),
                            base_for=base_for, executor=pool, writer=writer,
                            streamed=streamed)
            rows.append(("+ ingest", peak.mib()))
            packs, stored = footprint(index, blobs, result)
            rows.append(("+ packs and footprint", peak.mib()))
            dt = time.monotonic() - t0
            peak.stop()
        pages = args.mib * 256
        report.say(f"{args.mode}, {args.mib} MiB ({pages} distinct pages), {dt:.1f} s, "
                   f"{len(packs)} packs, footprint {stored >> 20} MiB, index {len(index)} "
                   "pages")
        rows.append(("(of which the index's growth, est.)",
                     (index_bytes(index) - index_before) / 1048576))
        report.units = {"growth": "MiB", "per_page": "bytes"}
        table = report.table("meta", [Col("phase"),
                                      Col("growth", "peak RssAnon growth", "{:.0f} MiB"),
                                      Col("per_page", "per page", "{:.0f} B")])
        for label, mib in rows:
            table.add(label, mib, mib * 1048576 / pages)
        report.show(table)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
