"""Benchmark: ways for a dump's pages to reach ckptd (docs/design/streaming.md).

One `counter --mem-mib N` process (every page random), dumped repeatedly through `criu swrk`
with leave-running (the same process each time), each way in turn, R rounds interleaved:

  staged-tmpfs  CRIU writes every image to a tmpfs directory (ckptd today, RAM staging)
  staged-disk   the same into a directory on disk (ckptd's fallback staging)
  ps-null       CRIU sends pages over the page-server protocol (opts.ps.fd); discarded
  ps-ingest     the same, pages hashed/compressed/packed into a store as they arrive
  fifo          pages-1.img pre-created as a FIFO, read and discarded by a thread

--sink-only: no CRIU; StreamedPages's own throughput, stage by stage.

Per way: CRIU's frozen time (stats-dump), CRIU's run until post-dump, until the pages are
durable in a store (staged ways: ckptd's ingest of the staging after CRIU, as its commit does),
extra bytes on the staging file system, and this process's peak RSS growth (VmHWM after
clear_refs; a tmpfs staging's own RAM is the staged column, not counted there).
Usage (root): .venv/bin/python -m bench stream [--mib 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import CRIU, kill, start_counter
from bench.report import Col, Report
from ckptd.adapters.criu import CriuSwrk
from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.criu.pageserver import PageServer
from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.core.ports import CriuDumpJob, CriuHooks
from ckptd.core.store.index import PageIndex
from ckptd.core.store.ingest import ingest
from ckptd.core.store.pagehash import PageHasher
from ckptd.core.store.streaming import StreamedPages


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class NullSink:
    def begin_image(self, name: str) -> None:
        pass

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        pass

    def end_image(self, name: str, size: int) -> None:
        pass


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_fifo())


def one(way: str, pid: int, base: Path, criu: CriuSwrk, store: Path) -> dict[str, float]:
    root = base / way
    shutil.rmtree(root, ignore_errors=True)
    images, work = root / "images", root / "work"
    images.mkdir(parents=True)
    work.mkdir()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0 = rss_kib("VmRSS")
    server: PageServer | None = None
    sink: StreamedPages | None = None
    reader: threading.Thread | None = None
    ps_fd = -1
    if way.startswith("ps-"):
        if way == "ps-ingest":
            pool, writer = ThreadPoolExecutor(2), ThreadPoolExecutor(1)
            blobs = LocalBlobStore(store)
            sink = StreamedPages(blobs=blobs, index=PageIndex(), hasher=PageHasher(b"k", 0),
                                 executor=pool, writer=writer)
        server = PageServer(images, sink if sink is not None else NullSink())
        ps_fd = server.criu_end().fileno()
    elif way == "fifo":
        fifo = images / "pages-1.img"
        os.mkfifo(fifo)

        def drain() -> None:
            with open(fifo, "rb", buffering=0) as fh:
                buf = bytearray(4 << 20)
                while fh.readinto(buf):
                    pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
    job = CriuDumpJob(pid=pid, images_dir=images, work_dir=work, leave_running=True,
                      page_server_fd=ps_fd)
    t0 = time.monotonic()
    if server is not None:
        server.start()
    dump = criu.dump(job, CriuHooks())
    t_held = time.monotonic() - t0
    if server is not None:  # every page received (CRIU closes the session before post-dump)
        server.close_criu_end()
        server.wait(60)
    result = dump.finish()  # the tree runs on (ckptd's let-go comes before its commit)
    if sink is not None:
        sink.finish()
    elif way.startswith("staged"):  # what ckptd's commit does today: ingest the staging
        with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
            ingest(images, blobs=LocalBlobStore(store), index=PageIndex(),
                   hasher=PageHasher(b"k", 0), is_pages_file=is_pages_image,
                   base_for=lambda _name: None, executor=pool, writer=writer)
    t_ingested = time.monotonic() - t0
    if reader is not None:
        reader.join(10)
    staged = dir_bytes(images)
    peak = rss_kib("VmHWM") - rss0
    shutil.rmtree(root, ignore_errors=True)
    return {"frozen": result.frozen_s, "held": t_held, "ingested": t_ingested,
            "staged_mib": staged / 2**20, "rss_mib": peak / 1024}


def sink_only(mib: int, report: Report) -> None:
    """``StreamedPages`` alone, fed 4 MiB chunks of distinct random pages: its throughput
    hashing only, + compressing, + writing packs, + flushing them (to /var/tmp)."""

    class NullBlobs(LocalBlobStore):
        def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
            return True

    class NoFlush(LocalBlobStore):
        def flush(self) -> None:
            pass

    chunk = 4 << 20
    pool_data = bytearray(os.urandom(chunk * 8))
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="bench-sink-"))
    table = report.table("sink", [Col("stage"), Col("throughput", fmt="{:.2f} GiB/s"),
                                  Col("time", fmt="{:.2f} s")],
                         note=f"StreamedPages fed {mib} MiB of distinct random pages")
    try:
        for label, blobs in (("hash only", None), ("+ compress", NullBlobs(root / "n")),
                             ("+ write packs", NoFlush(root / "w")),
                             ("+ flush", LocalBlobStore(root / "f"))):
            with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
                hasher = PageHasher(b"k", 0)
                sink = StreamedPages(blobs=blobs or NullBlobs(root / "h"), index=PageIndex(),
                                     hasher=hasher, executor=pool, writer=writer)
                sink.begin_image("pages-1.img")
                t0 = time.monotonic()
                for i in range(mib // 4):
                    at = (i % 8) * chunk
                    for p in range(0, chunk, 4096):  # distinct pages in every chunk
                        pool_data[at + p : at + p + 4] = (i * 1024 + p).to_bytes(4, "little")
                    view = memoryview(pool_data)[at : at + chunk]
                    if blobs is None:
                        for off in range(0, chunk, 4096):
                            hasher.digest(view[off : off + 4096])
                    else:
                        sink.pages("pages-1.img", i * chunk, view)
                if blobs is not None:
                    sink.finish()
                dt = time.monotonic() - t0
            table.add(label, mib / 1024 / dt, dt)
        report.show(table)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ways", default="staged-tmpfs,staged-disk,ps-null,ps-ingest,fifo")
    ap.add_argument("--sink-only", action="store_true", help="StreamedPages alone, no CRIU")


def run(args: argparse.Namespace, report: Report) -> int:
    report.units = {"time": "s", "size": "MiB"}
    if args.sink_only:
        sink_only(args.mib, report)
        return 0
    ways = args.ways.split(",")
    criu = CriuSwrk(CRIU, plugin_dir=Path(tempfile.mkdtemp()) / "plugins")
    tmpfs = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-stream-"))
    disk = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="bench-stream-"))
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="bench-stream-out-"))
    pid = start_counter(work / "counter.out", mib=args.mib)
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    try:
        for _ in range(args.rounds):
            for way in ways:
                base = disk if way == "staged-disk" else tmpfs
                store = disk / "store"
                shutil.rmtree(store, ignore_errors=True)
                rows[way].append(one(way, pid, base, criu, store))
                shutil.rmtree(store, ignore_errors=True)
                subprocess.run(["sync"], check=False)
    finally:
        kill(pid)
        for d in (tmpfs, disk, work):
            shutil.rmtree(d, ignore_errors=True)
    keys = ("frozen", "held", "ingested", "staged_mib", "rss_mib")
    table = report.table("stream", [
        Col("way"), Col("frozen", "CRIU frozen s", "{:.2f}"),
        Col("held", "CRIU to post-dump s", "{:.2f}"),
        Col("ingested", "pages durable s", "{:.2f}"), Col("staged_mib", "staged MiB", "{:.2f}"),
        Col("rss_mib", "receiver RSS growth MiB", "{:.2f}"),
        *(Col(f"{k}_range", f"{k} min-max") for k in keys),
    ], note=f"{args.mib} MiB process, {args.rounds} rounds, median (min-max); CRIU {CRIU}")
    for way, runs in rows.items():
        vals = {k: [r[k] for r in runs] for k in keys}
        table.add(way, *(statistics.median(vals[k]) for k in keys),
                  *(f"{min(vals[k]):.2f}-{max(vals[k]):.2f}" for k in keys))
    report.show(table)
    return 0
