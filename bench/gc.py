"""Benchmark of GC compaction (issue 24, point 4; a script you run, not a timed test).

A job churning scattered memory (`bigmem --mib 256 --rewrite-pct P`: every step rewrites P%
of its non-zero pages, random ones) is checkpointed N times (default 30) with
`ckptctl dump --leave-running --name churn --keep 3` — what a periodic policy with keep 3
does, back to back instead of every 10 s — then `ckptctl gc` runs once. Measured:

- the store's packs before and after GC, against the *unique bytes* of the 3 kept
  checkpoints: their distinct non-zero pages, as stored (each page's share of its compressed
  frame) and as pages (4 KiB each);
- GC's time in the daemon (ckptctl's wall time less its start-up, timed on a `list`), per
  GiB of packs it found, against a dump's time per GiB (the dumps' ``duration_s`` over
  their ``bytes_logical``).

Targets: after GC the packs hold <= 1.5x the unique stored bytes of the kept checkpoints, and
GC takes well under (here: < 0.5x) one dump's time per GiB. `--no-compact` runs the same
without compaction (GC as it was before it: the threshold is no setting, so GC runs from this
tree with ``compact_below = 0`` on the stopped daemon's store).

Usage (root): .venv/bin/python -m bench gc [--mib 256] [--dumps 30] [--keep 3]
                  [--rewrite-pct 2] [--steps-between 2] [--dir /var/tmp/x] [--no-compact]
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Daemon, build_workloads, kill, need_root, start_bigmem, timed
from bench.report import Col, Report
from ckptd.adapters.clock import SystemClock
from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore, keyfile
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.pagehash import ZERO_REF

GIB = 1 << 30


def pack_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "packs").rglob("*") if p.is_file())


def unique_bytes(cas: ContentStore, ids: list[str]) -> tuple[int, int]:
    """(distinct non-zero pages of ``ids`` as stored: each one's share of its frame's
    stored length; the same pages at 4 KiB each)."""
    pages: set[bytes] = set()
    for cid in ids:
        for refs in cas.page_refs(cid).values():
            pages.update(refs)
    pages.discard(ZERO_REF)
    stored = 0.0
    for h in pages:
        loc = cas.index.get(h)
        if loc is not None:
            frame = cas.index.packs[loc.pack_id].frames[loc.frame]
            stored += frame.length / len(frame.hashes)
    return int(stored), len(pages) * 4096


def open_store(work: Path) -> ContentStore:
    keys = keyfile.load(work / "state" / "manifest.keys")
    assert keys is not None, "the daemon wrote no manifest key file"
    return ContentStore(LocalBlobStore(work / "store"), StagingPolicy(None, work / "staging"),
                        clock=SystemClock(), is_pages_file=is_pages_image, keys=keys)


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dumps", type=int, default=30)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--rewrite-pct", type=int, default=2)
    ap.add_argument("--steps-between", type=int, default=2,
                    help="workload steps (of 200 ms) between dumps")
    ap.add_argument("--dir", default="")
    ap.add_argument("--no-compact", action="store_true")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    build_workloads()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-gc-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "ckptd.toml"
    conf.write_text("gc_grace_s = 0.0\ngc_interval_s = 0.0\n")
    daemon = Daemon(work, args=("--config", str(conf)))
    env, ctl = daemon.env, daemon.ctl
    pid = 0
    try:
        pid = start_bigmem(work / "ready", mib=args.mib, out=work / "job.out",
                           extra=f"--rewrite-pct {args.rewrite_pct}")
        dumps: list[dict[str, Any]] = []
        t_start = time.monotonic()
        for i in range(args.dumps):
            time.sleep(0.2 * args.steps_between)
            wall, text = timed([*ctl, "dump", str(pid), "--leave-running", "--name", "churn",
                                "--keep", str(args.keep)], env=env)
            dumps.append({**json.loads(text), "wall_s": wall})
            print(f"dump {i + 1}/{args.dumps}: {dumps[-1]['duration_s']:.2f}s, "
                  f"store {pack_bytes(work / 'store') / 2**20:.0f} MiB", file=sys.stderr)
        churn_s = time.monotonic() - t_start
        kill(pid)
        store = work / "store"
        before = pack_bytes(store)
        ctl_s, text = timed([*ctl, "list", "--name", "churn"], env=env)
        kept = [c["id"] for c in json.loads(text)]
        if args.no_compact:
            daemon.stop()
            cas = open_store(work)
            cas.gc_grace_s = 0.0
            t0 = time.perf_counter()
            gc_report: dict[str, Any] = vars(cas.collect_garbage(compact_below=0))
            gc_s = time.perf_counter() - t0
        else:
            gc_s, text = timed([*ctl, "gc"], env=env)
            gc_report = json.loads(text)
            daemon.stop()
            cas = open_store(work)
        after = pack_bytes(store)
        uniq_stored, uniq_pages = unique_bytes(cas, kept)
        verify = cas.verify()
        dump_s = sum(d["duration_s"] for d in dumps)
        dump_wall = sum(d["wall_s"] for d in dumps)
        dump_gib = sum(d["bytes_logical"] for d in dumps) / GIB
        dump_s_gib = dump_s / dump_gib
        if not args.no_compact:  # ckptctl's own start (Python, grpc), as a `list` takes
            gc_s = max(gc_s - ctl_s, 0.0)
        gc_s_gib = gc_s / (before / GIB)
        ratio = after / uniq_stored
        ok_size = ratio <= 1.5
        ok_time = gc_s_gib < 0.5 * dump_s_gib
        mode = "off" if args.no_compact else "on"
        table = report.table("gc", ["measure", "value", "target", "met"], note=(
            f"{args.dumps} dumps of bigmem --mib {args.mib} --rewrite-pct "
            f"{args.rewrite_pct} ({args.steps_between} steps between), --keep {args.keep}, "
            f"in {churn_s:.0f} s; compaction {mode}; verify "
            f"{'clean' if verify.ok else verify.problems}"))
        table.add("packs before gc", f"{before / 2**20:.0f} MiB", "", "")
        table.add("packs after gc", f"{after / 2**20:.0f} MiB", "", "")
        table.add(f"unique bytes of the {len(kept)} kept (stored / as pages)",
                  f"{uniq_stored / 2**20:.0f} / {uniq_pages / 2**20:.0f} MiB", "", "")
        table.add("after / unique stored", f"{ratio:.2f}x", "<= 1.5x",
                  "yes" if ok_size else "NO")
        table.add(f"gc (in the daemon: ckptctl's {ctl_s:.2f} s start-up taken off)",
                  f"{gc_s:.2f} s ({gc_s_gib:.2f} s/GiB of packs); rewrote "
                  f"{gc_report.get('packs_rewritten', 0)} pack(s), "
                  f"{int(gc_report.get('bytes_rewritten', 0)) / 2**20:.0f} MiB; freed "
                  f"{int(gc_report.get('bytes_freed', 0)) / 2**20:.0f} MiB", "", "")
        table.add(f"a dump (its duration_s, until durable; ckptctl's wall "
                  f"{dump_wall / len(dumps):.2f} s)",
                  f"{dump_s / len(dumps):.2f} s of {dump_gib * 1024 / len(dumps):.0f} MiB of "
                  f"images ({dump_s_gib:.2f} s/GiB)", "gc s/GiB < 0.5x a dump's",
                  f"{'yes' if ok_time else 'NO'} ({gc_s_gib / dump_s_gib:.2f}x)")
        report.show(table)
        summary = report.table("figures", [
            Col("compaction"), Col("packs_before_mib", fmt="{:.0f}"),
            Col("packs_after_mib", fmt="{:.0f}"), Col("unique_stored_mib", fmt="{:.0f}"),
            Col("freed_mib", fmt="{:.0f}"), Col("gc_s", fmt="{:.2f}"),
            Col("dump_s", fmt="{:.2f}")])
        summary.add(mode, before / 2**20, after / 2**20, uniq_stored / 2**20,
                    int(gc_report.get("bytes_freed", 0)) / 2**20, gc_s, dump_s / len(dumps))
        report.show(summary)
        report.units = {"size": "MiB", "time": "s"}
        return 0 if verify.ok else 1
    finally:
        if pid:
            kill(pid)
        daemon.stop()
