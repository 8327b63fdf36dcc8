"""Lazy restore (issue 25, direction 5): time until the job runs, ckptd against raw CRIU, side
by side in one run (a script you run, not a test).

For each size (default 1 GiB and 4 GiB) and memory kind, a fresh ``bigmem`` each time:

  raw eager    ``criu restore -D DIR -d`` until it returns (every page read first)
  raw lazy     ``criu lazy-pages -D DIR`` started first (pages from the image directory, not
               verified), then ``criu restore --lazy-pages -D DIR -d`` until it returns (the
               job runs); "all in": until the lazy-pages daemon exits (every page served)
  ckptd lazy   ``Restore(lazy=true)`` through the daemon's gRPC API until its result (the job
               runs; every page is then served from the store, verified); "all in": until
               the daemon's ``restore.lazy_done`` event
  ckptd eager  ``Restore`` of the same checkpoint (a second bigmem) until its result

Usage (root): .venv/bin/python -m bench lazy [--sizes 1024,4096] [--kinds mixed]
Prints one Markdown table (seconds) and the ratios against the issue's target (time to
running for 4 GiB <= 0.2 s).
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import CRIU, CRIU_FLAGS, RawCriu, build_workloads, kill, need_root, wait_gone
from bench.report import Col, Report
from bench.speed import daemon_at, start_bigmem_of, stream, stub_at
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb

RAW = RawCriu()


def raw_lazy(mib: int, kind: str, work: Path) -> dict[str, float]:
    """Raw CRIU: an eager restore, then a lazy one, of the same dump (two bigmems)."""
    images = work / "raw-images"
    pid = start_bigmem_of(mib, kind, work / "raw.out")
    RAW.dump(pid, images)
    wait_gone(pid)
    eager = RAW.restore(images)
    kill(pid)
    status_r, status_w = os.pipe()
    daemon = subprocess.Popen(
        [CRIU, "lazy-pages", "-D", str(images), "-W", str(images), "-o", "lazy-pages.log",
         "-v4", "--status-fd", str(status_w)], pass_fds=(status_w,))
    os.close(status_w)
    select.select([status_r], [], [], 30)
    os.close(status_r)
    t0 = time.perf_counter()
    subprocess.run([CRIU, "restore", "-D", str(images), "-d", "--lazy-pages",
                    "-o", "restore-lazy.log", *CRIU_FLAGS], check=True, capture_output=True)
    running = time.perf_counter() - t0
    daemon.wait(timeout=600)
    all_in = time.perf_counter() - t0
    kill(pid)
    shutil.rmtree(images, ignore_errors=True)
    return {"raw_eager": eager, "raw_lazy": running, "raw_all_in": all_in}


def ckptd_lazy(mib: int, kind: str, work: Path, stub: Any) -> dict[str, float]:
    """ckptd: a lazy restore (until it returns, and until restore.lazy_done), then an eager
    one of the same checkpoint."""
    pid = start_bigmem_of(mib, kind, work / "ckptd.out")
    ck = stream(stub.Dump(pb.DumpRequest(pid=pid), timeout=3600), "checkpoint")
    wait_gone(pid)
    done = threading.Event()
    lazy_done: list[float] = []

    def watch() -> None:
        kinds = ["restore.lazy_done", "restore.lazy_failed"]
        for event in stub.Watch(pb.WatchRequest(follow=True, kinds=kinds), timeout=3600):
            lazy_done.append(time.perf_counter())
            if event.kind == "restore.lazy_failed":
                print(f"lazy restore failed: {event.message}", file=sys.stderr)
            done.set()
            return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.3)  # the watch subscribed
    t0 = time.perf_counter()
    res = stream(stub.Restore(pb.RestoreRequest(checkpoint_id=ck.id, lazy=True),
                              timeout=3600), "result")
    running = time.perf_counter() - t0
    if not done.wait(600):
        raise SystemExit("no restore.lazy_done in 600 s")
    all_in = lazy_done[0] - t0
    kill(res.pid)
    t0 = time.perf_counter()
    res = stream(stub.Restore(pb.RestoreRequest(checkpoint_id=ck.id), timeout=3600),
                 "result")
    eager = time.perf_counter() - t0
    kill(res.pid)
    return {"ckptd_lazy": running, "ckptd_all_in": all_in, "ckptd_eager": eager}


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--kinds", default="mixed")
    ap.add_argument("--dir", default="", help="work directory (default: a temp dir in /var/tmp)")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    build_workloads()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-lazy-", dir="/var/tmp"))
    report.units = {"time": "s"}
    table = report.table("lazy", [
        Col("size_gib", "size", "{:g} GiB"), Col("kind"),
        Col("raw_eager", "raw restore", "{:.3f}"), Col("raw_lazy", "raw lazy", "{:.3f}"),
        Col("raw_all_in", "raw lazy, all in", "{:.2f}"),
        Col("ckptd_eager", "ckptd restore", "{:.3f}"),
        Col("ckptd_lazy", "ckptd --lazy", "{:.3f}"),
        Col("ckptd_all_in", "ckptd --lazy, all in", "{:.2f}"),
        Col("lazy_vs_raw_lazy", "--lazy / raw lazy", "{:.2f}x"),
        Col("target", "--lazy <= 0.2 s", "{}"),
    ], note=f"kernel {os.uname().release}, {os.cpu_count()} CPUs, CRIU {CRIU}; seconds until "
            "the job runs, and until every page is in")
    for mib in (int(s) for s in args.sizes.split(",") if s):
        for kind in args.kinds.split(","):
            print(f"{mib} MiB {kind}", file=sys.stderr)
            row = raw_lazy(mib, kind, work)
            with daemon_at(work / f"d-{mib}-{kind}") as (sock, _pid, _staging):
                stub = stub_at(sock)
                row.update(ckptd_lazy(mib, kind, work, stub))
            table.add(mib / 1024, kind, row["raw_eager"], row["raw_lazy"], row["raw_all_in"],
                      row["ckptd_eager"], row["ckptd_lazy"], row["ckptd_all_in"],
                      row["ckptd_lazy"] / row["raw_lazy"],
                      "met" if row["ckptd_lazy"] <= 0.2 else "missed")
    report.show(table)
    shutil.rmtree(work, ignore_errors=True)
    return 0
