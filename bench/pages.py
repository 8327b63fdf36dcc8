"""Benchmark of the store's data path alone (a script you run, not a test): no CRIU, no daemon.

A pages image of N MiB is committed into an empty store (ingest: split, hash, dedup,
compress, pack, write, durable) and checked out again (every frame read, decompressed,
verified and written into a sparse file), in this process. Two images:

  random   every page random (what `counter --mem-mib` holds): nothing compresses
  mixed    like `bigmem`: ~40% float32-like weights, ~30% zero pages, ~30% text records

``--compare-with TREE`` runs the same rounds, alternating, with the ckptd of another source
tree (e.g. ``git archive <commit> | tar -x -C /tmp/before``): before and after side by side,
in one run. Prints a Markdown table (median of ``--repeat`` rounds, MB = 10^6 bytes of the
image per second).

Usage: .venv/bin/python -m bench pages [--mib 1024] [--repeat 3] [--dir /var/tmp]
           [--compare-with /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT
from bench.report import Col, Report

PAGE = 4096
CHUNK = 1024  # pages generated at a time


RECORD = b'{"id":000000,"user":"u0000","event":"view","score":00.0,"ok":1}\n'
FLOAT_HIGH = bytes.maketrans(bytes(range(256)), bytes(b"<\xbc=\xbd"[b % 4] for b in range(256)))
FLOAT_MID = bytes.maketrans(bytes(range(256)), bytes(b & 0x8F | 0x40 for b in range(256)))
DIGITS = bytes.maketrans(bytes(range(256)), bytes(48 + b % 10 for b in range(256)))


def make_image(path: Path, mib: int, kind: str) -> None:
    """Write a pages image, every page distinct (but zero pages), at C speed: page kinds by
    index; weights: random float32 mantissas under a few sign/exponent bytes; text: 64-byte
    JSON records with random digits."""
    assert len(RECORD) == 64
    rng = random.Random(mib)
    spots = [i for i, c in enumerate(RECORD) if c == ord("0")]
    text_page = RECORD * (PAGE // 64)
    with path.open("wb") as out:
        for _ in range(mib * 256 // CHUNK):
            chunk = bytearray(os.urandom(CHUNK * PAGE))
            if kind == "mixed":
                view = memoryview(chunk)
                for p in range(CHUNK):
                    page = view[p * PAGE : (p + 1) * PAGE]
                    r = rng.random()
                    if r < 0.4:
                        page[3::4] = bytes(page[3::4]).translate(FLOAT_HIGH)
                        page[2::4] = bytes(page[2::4]).translate(FLOAT_MID)
                    elif r < 0.7:
                        page[:] = bytes(PAGE)
                    else:
                        noise = bytes(page).translate(DIGITS)
                        page[:] = text_page
                        for k, at in enumerate(spots):
                            page[at::64] = noise[k * 64 : (k + 1) * 64]
            out.write(chunk)


def one_round(images: Path, work: Path) -> dict[str, float]:
    """Commit ``images`` into a new store under ``work``, then check it out: seconds, bytes."""
    from ckptd.adapters.criu.images import is_pages_image
    from ckptd.adapters.storage import LocalBlobStore
    from ckptd.core.store.cas import ContentStore, StagingPolicy
    from ckptd.core.store.keys import ManifestKeys
    from ckptd.domain import CheckpointRecord, ProcessFact, new_checkpoint_id
    from ckptd.testing import FakeClock

    shutil.rmtree(work, ignore_errors=True)
    clock = FakeClock()
    store = ContentStore(LocalBlobStore(work / "objects"), StagingPolicy(None, work / "staging"),
                         clock=clock, is_pages_file=is_pages_image, keys=ManifestKeys.generate(),
                         workers=os.cpu_count() or 2)
    clock.advance(1)
    rec = CheckpointRecord(id=new_checkpoint_id(clock.time()), pid=1, created=clock.time(),
                           node="bench", uid=0, name="bench",
                           processes=(ProcessFact(1, 0, "bench", ("bench",), 0, 0),))
    staged = store.begin(rec.id)
    for p in images.iterdir():
        os.link(p, staged / p.name)
    os.sync()
    t0 = time.perf_counter()
    done = store.commit(rec)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    with store.checkout(done.id):
        t3 = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    return {"ingest_s": t1 - t0, "checkout_s": t3 - t2, "bytes": float(done.bytes_new)}


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="where the images and stores go")
    ap.add_argument("--compare-with", default="", help="another ckptd source tree (before)")
    ap.add_argument("--round", nargs=2, metavar=("IMAGES", "WORK"), help=argparse.SUPPRESS)


def run(args: argparse.Namespace, report: Report) -> int:
    if args.round:  # one measurement, in the interpreter the caller chose (PYTHONPATH)
        print(json.dumps(one_round(Path(args.round[0]), Path(args.round[1]))))
        return 0
    base = Path(tempfile.mkdtemp(prefix="ckptd-bench-pages-", dir=args.dir))
    trees = {"this tree": ROOT}
    if args.compare_with:
        trees = {f"before ({args.compare_with})": Path(args.compare_with), **trees}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for kind in ("random", "mixed"):
            images = base / kind
            images.mkdir()
            make_image(images / "pages-1.img", args.mib, kind)
            for r in range(args.repeat):
                for name, tree in trees.items():
                    print(f"{kind} round {r + 1}/{args.repeat}: {name}", file=sys.stderr)
                    # that tree's ckptd, this tree's bench package (after it on the path)
                    env = {**os.environ, "PYTHONPATH": f"{tree}:{ROOT}"}
                    out = subprocess.run(
                        [sys.executable, "-m", "bench", "pages", "--round", str(images),
                         str(base / "work")],
                        env=env, check=True, capture_output=True, text=True,
                    ).stdout
                    results.setdefault((kind, name), []).append(json.loads(out))
            shutil.rmtree(images)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    size = args.mib << 20
    report.units = {"time": "s", "rate": "MB/s", "bytes": "bytes"}
    table = report.table("pages", [
        Col("image"), Col("code"), Col("ingest", "ingest (s)", "{:.2f}"),
        Col("ingest_rate", "ingest MB/s", "{:.0f}"), Col("checkout", "checkout (s)", "{:.2f}"),
        Col("checkout_rate", "checkout MB/s", "{:.0f}"),
        Col("stored_bytes", "stored bytes", "{:,}"),
    ], note=f"Store data path, {args.mib} MiB pages image, store in {args.dir}, median of "
            f"{args.repeat}; {os.cpu_count()} CPUs, kernel {os.uname().release}")
    for (kind, name), rows in results.items():
        ingest = statistics.median(r["ingest_s"] for r in rows)
        out_s = statistics.median(r["checkout_s"] for r in rows)
        stored = int(statistics.median(r["bytes"] for r in rows))
        table.add(kind, name, ingest, size / ingest / 1e6, out_s, size / out_s / 1e6, stored)
    report.show(table)
    return 0
