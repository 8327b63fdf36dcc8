"""Benchmark of the checkpoint store (a script you run, not a timed test).

A workload of N GiB (`bigmem`: ~40% random float32 "weights", ~30% zero pages, ~30% text-like
records) is checkpointed, in one run, side by side:

  (a) raw `criu dump --leave-running` to a local directory: wall time, frozen time, bytes
  (b) (a) then `zstd -1 -T0` over the images (tar | zstd): time, bytes
  (c) ckptd full checkpoint into an empty store (`ckptctl dump --leave-running`): frozen
      time, time until committed, bytes stored
  (d) ckptd checkpoint after the workload rewrote a random 5% of its pages: bytes added,
      time; compared with the zstd -1 size of exactly the pages that changed
  (e) restore: raw `criu restore -d` vs `ckptctl restore`, time until the process runs

``--baseline TREE`` runs (c)-(e) also through a second daemon running the ckptd of another
source tree (e.g. ``git archive <commit> | tar -x -C /tmp/before``), each with its own
store, on the same process: before and after side by side, in one run. The daemon of this
tree runs this tree's code (PYTHONPATH), whatever the venv has installed.

Usage (root): .venv/bin/python -m bench store [--gib 1] [--dir /var/tmp/x]
                  [--baseline /tmp/before [--baseline-last]]
Prints a Markdown table with ratios and the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard

from bench.common import (
    ROOT,
    Daemon,
    RawCriu,
    build_workloads,
    dir_bytes,
    kill,
    need_root,
    start_bigmem,
    timed,
)
from bench.report import Col, Report
from ckptd.adapters.criu.images import read_dump_stats


class Ckptd(Daemon):
    """A daemon (and its ckptctl) running the ckptd of one source tree, with its own store."""

    def __init__(self, name: str, tree: Path, work: Path) -> None:
        super().__init__(work, tree=tree)
        self.name = name

    def run(self, *args: str) -> tuple[float, dict[str, Any]]:
        t, text = timed([*self.ctl, *args], env=self.env)
        return t, json.loads(text)


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gib", type=float, default=1.0, help="workload size in GiB (default 1)")
    ap.add_argument("--dir", default="", help="work directory (default: new one in /var/tmp)")
    ap.add_argument("--baseline", default="", help="another ckptd source tree to compare with")
    ap.add_argument("--baseline-last", action="store_true",
                    help="run this tree's daemon first in each step (the first dump of a "
                         "step can find colder caches: run both orders)")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    mib = int(args.gib * 1024)
    build_workloads()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-store-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    daemons: list[Ckptd] = []
    pids: list[int] = []
    rows: dict[str, dict[str, Any]] = {}
    raw_criu = RawCriu()
    try:
        daemons.append(Ckptd("ckptd", ROOT, work / "this"))
        if args.baseline:
            before = Ckptd("before", Path(args.baseline).resolve(), work / "before")
            daemons.insert(len(daemons) if args.baseline_last else 0, before)
        # stdout to /dev/null: a growing file could not be restored from the older raw dump
        pid = start_bigmem(work / "ready", mib=mib, interval_ms=500)
        pids.append(pid)
        print(f"workload pid {pid}: {mib} MiB", file=sys.stderr)

        # (a) raw criu dump
        raw = work / "raw"
        t_a = raw_criu.dump(pid, raw, leave_running=True)
        stats = read_dump_stats(raw)
        frozen_a = stats.frozen_time / 1e6 if stats else float("nan")
        (raw / "dump.log").unlink()
        bytes_a = dir_bytes(raw)

        # (b) zstd -1 -T0 over the images
        t_b, _ = timed(["sh", "-c", f"tar -C {raw} -cf - . | zstd -1 -T0 -q -o {work}/raw.tar.zst"])
        bytes_b = (work / "raw.tar.zst").stat().st_size

        # (c) full checkpoint into an empty store, by each daemon
        for d in daemons:
            t, c = d.run("dump", str(pid), "--leave-running", "--name", "bench")
            rows[d.name] = {"t_c": t, "c": c}

        # (d) after a 5% rewrite: it happens at the next step: wait for two steps of 0.5 s.
        os.kill(pid, signal.SIGUSR1)
        time.sleep(1.5)
        for d in daemons:
            t, dd = d.run("dump", str(pid), "--leave-running", "--name", "bench")
            rows[d.name].update(t_d=t, d=dd)
        this = rows["ckptd"]
        changed, changed_zstd = changed_pages(work / "this" / "store", this["c"]["id"],
                                              this["d"]["id"])

        # (e) restores
        kill(pid)
        t_e_raw = raw_criu.restore(raw)
        kill(pid)
        for d in daemons:
            t, restored = d.run("restore", rows[d.name]["d"]["id"])
            pids.append(restored["pid"])
            time.sleep(0.5)
            rows[d.name].update(t_e=t, alive=Path(f"/proc/{restored['pid']}").exists())
            kill(restored["pid"])
    finally:
        for p in pids:
            kill(p)
        for d in daemons:
            d.stop()

    def ok(flag: bool) -> str:
        return "met" if flag else "**missed**"

    report.units = {"time": "s", "bytes": "bytes"}
    table = report.table("store", [
        Col("step"), Col("time", "time (s)", "{:.2f}"), Col("frozen", "frozen (s)", "{:.2f}"),
        Col("bytes", fmt="{:,}"), Col("ratio"), Col("target"),
    ], note=f"Workload: bigmem {mib} MiB (40% float32, 30% zero, 30% text); images "
            f"{bytes_a:,} bytes; kernel {os.uname().release}, {os.cpu_count()} CPUs")
    table.add("(a) raw criu dump", t_a, frozen_a, bytes_a, "1.00x", "")
    table.add("(b) (a) + zstd -1 -T0", t_a + t_b, frozen_a, bytes_b,
              f"time {(t_a + t_b) / t_a:.2f}x (a)", "")
    for name, r in rows.items():
        c, d, t_c, t_d = r["c"], r["d"], r["t_c"], r["t_d"]
        label = "ckptd" if name == "ckptd" else f"ckptd {name} ({args.baseline})"
        table.add(f"(c) {label} full", t_c, c["frozen_s"], c["bytes_new"],
                  f"time {t_c / t_a:.2f}x (a), bytes {c['bytes_new'] / bytes_b:.2f}x (b), "
                  f"frozen {c['frozen_s'] / frozen_a:.2f}x (a)",
                  f"time <= 1.0x: {ok(t_c <= t_a)}; bytes <= 1.0x: "
                  f"{ok(c['bytes_new'] <= bytes_b)}; frozen <= 1.1x: "
                  f"{ok(c['frozen_s'] <= 1.1 * frozen_a)}")
        table.add(f"(d) {label} after 5% rewrite", t_d, d["frozen_s"], d["bytes_new"],
                  f"bytes {d['bytes_new'] / changed_zstd:.2f}x zstd of the {changed:,} "
                  f"changed pages ({changed_zstd:,} B); time {t_d / t_c:.2f}x (c)",
                  f"bytes <= 1.2x: {ok(d['bytes_new'] <= 1.2 * changed_zstd)}; time <= 0.5x: "
                  f"{ok(t_d <= 0.5 * t_c)}")
    table.add("(e) raw criu restore", t_e_raw, None, None, "1.00x", "")
    for name, r in rows.items():
        label = "ckptd" if name == "ckptd" else f"ckptd {name}"
        t_e = r["t_e"]
        table.add(f"(e) ckptctl restore ({label})", t_e, None, None, f"{t_e / t_e_raw:.2f}x raw",
                  f"<= 1.2x: {ok(t_e <= 1.2 * t_e_raw)} (restored process alive: {r['alive']})")
    report.show(table)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def changed_pages(store_root: Path, first: str, second: str) -> tuple[int, int]:
    """How many pages of ``second`` are not in ``first``, and their size under zstd -1."""
    from ckptd.adapters.clock import SystemClock
    from ckptd.adapters.criu.images import is_pages_image
    from ckptd.adapters.storage import LocalBlobStore, keyfile
    from ckptd.core.store.cas import ContentStore, StagingPolicy
    from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF

    keys, _ = keyfile.load_or_create(store_root.parent / "state" / "manifest.keys")
    store = ContentStore(LocalBlobStore(store_root), StagingPolicy(None, store_root / "tmp"),
                         clock=SystemClock(), is_pages_file=is_pages_image, keys=keys)
    old = {r for refs in store.page_refs(first).values() for r in refs}
    new_data: list[bytes] = []
    with store.checkout(second) as images:
        for name, refs in store.page_refs(second).items():
            data = (images / name).read_bytes()
            for i, ref in enumerate(refs):
                if ref != ZERO_REF and ref not in old:
                    new_data.append(data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
                    old.add(ref)
    blob = b"".join(new_data)
    return len(new_data), len(zstandard.ZstdCompressor(level=1, threads=-1).compress(blob))
