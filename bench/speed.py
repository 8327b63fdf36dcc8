"""Benchmark of issue #13's targets: ckptd against raw CRIU, side by side in one run (a script
you run, not a test).

For each size (default 1 GiB and 4 GiB) and memory kind (`mixed`: bigmem's 40% float32 /
30% zero / 30% text pages; `random`: every page random bytes), with a fresh `bigmem`
process each time:

  raw          `criu dump -t PID -D DIR` (kills it) — wall and frozen time (CRIU's stats);
               `+ sync -f DIR` (ckptd makes a checkpoint durable before it is listed);
               `tar -C DIR -cf - . | zstd -1 -T0 | wc -c` (the bytes a plain compressed copy
               of the images costs); `criu restore -D DIR -d` until it returns (the process
               runs)
  ckptd gRPC   Dump then Restore through the daemon's gRPC API from this process (no CLI
               start-up): wall, frozen (the record's), stored bytes (new bytes in the store),
               the daemon's peak extra RSS and the peak bytes in its staging directories
               (sampled every 20 ms)
  ckptd CLI    `ckptctl dump PID` and `ckptctl restore ID` (the CLI's start-up included)
  incremental  (mixed only) a leave-running full checkpoint, then SIGUSR1 (bigmem rewrites 5%
               of its non-zero pages), then a second leave-running checkpoint: its wall time
               against the full one's, its new bytes against the bytes changed

  --also K=V   (repeatable) one more daemon with setting K = V (TOML value, e.g.
               stream_pages=false), dumped and restored through gRPC in the same rounds:
               one more row per setting, side by side with the default daemon's
  --small N    also issue 25's small job: a tiny `counter` dumped and restored with raw CRIU
               and with `ckptctl` (start-up included), median of N (`--sizes ""`: only this)

Usage (root): .venv/bin/python -m bench speed [--sizes 1024,4096]
              [--kinds mixed,random] [--dir DIR] [--also stream_pages=false]
Prints one Markdown table of raw figures and one of ratios against issue #13's targets.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import (
    CRIU,
    RawCriu,
    build_workloads,
    command_of,
    dir_bytes,
    kill,
    need_root,
    start_bigmem,
    start_counter,
    timed,
    wait_gone,
)
from bench.report import Col, Report
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc as pb_grpc
from ckptd.adapters.criu.images import read_dump_stats

PAGE = 4096
RAW = RawCriu()
VENV = Path(sys.executable).parent
LOG_LEVEL = os.environ.get("BENCH_LOG", "WARNING")
"""The benchmark daemons' log level (BENCH_LOG=INFO: their logs say where time goes)."""


@dataclass
class Row:
    dump_s: float = 0.0
    frozen_s: float = 0.0
    restore_s: float = 0.0
    stored: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def start_bigmem_of(mib: int, kind: str, out: Path) -> int:
    """A fresh ``bigmem`` of ``kind`` (mixed, random) once its memory is filled."""
    return start_bigmem(out.with_suffix(".ready"), mib=mib, out=out,
                        extra="--random" if kind == "random" else "")


class Sampler:
    """Peak RSS of a process and peak bytes under some directories, sampled every 20 ms."""

    def __init__(self, pid: int, dirs: list[Path]) -> None:
        self.pid, self.dirs = pid, dirs
        self.base_rss = self._rss()
        self.peak_rss = self.base_rss
        self.peak_dir = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, self._rss())
            total = 0
            for d in self.dirs:
                with contextlib.suppress(OSError):
                    total += dir_bytes(d)
            self.peak_dir = max(self.peak_dir, total)

    @contextlib.contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


@contextlib.contextmanager
def daemon_at(root: Path, setting: str = "") -> Iterator[tuple[Path, int, list[Path]]]:
    """A daemon with a store and state of its own under ``root``, ``setting`` (``K=V``) in its
    configuration: (socket, pid, its staging directories: the state directory's and its own
    under /run/ckptd/staging, ``<tag>-<random>``)."""
    root.mkdir(parents=True)
    sock, state = root / "ckptd.sock", root / "state"
    config: list[str] = []
    criu = ["--criu", os.environ["CKPTD_CRIU"]] if os.environ.get("CKPTD_CRIU") else []
    if setting:
        key, value = setting.split("=", 1)
        (root / "ckptd.toml").write_text(f"{key.strip()} = {value.strip()}\n")
        config = ["--config", str(root / "ckptd.toml")]
    with (root / "ckptd.log").open("w") as log:
        daemon = subprocess.Popen(
            [*command_of("ckptd", VENV), "--socket", str(sock), "--store", str(root / "store"),
             "--state-dir", str(state), "--log-level", LOG_LEVEL, *criu, *config], stderr=log)
    try:
        while not sock.exists():
            if daemon.poll() is not None:
                raise SystemExit(f"ckptd exited: see {root / 'ckptd.log'}")
            time.sleep(0.05)
        tag = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]
        yield sock, daemon.pid, [state / "staging",
                                 *sorted(Path("/run/ckptd/staging").glob(f"{tag}-*"))]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
        shutil.rmtree(root / "store", ignore_errors=True)


def stub_at(sock: Path) -> Any:
    """A Checkpointer stub on the daemon's unix socket ``sock``."""
    return pb_grpc.CheckpointerStub(  # type: ignore[no-untyped-call]
        grpc.insecure_channel(f"unix:{sock}"))


def raw(mib: int, kind: str, work: Path) -> Row:
    pid = start_bigmem_of(mib, kind, work / "raw.out")
    images = work / "raw-images"
    t_dump = RAW.dump(pid, images)
    t_sync = RAW.sync(images)
    stats = read_dump_stats(images)
    wait_gone(pid)
    zstd = zstd_bytes(images)
    t_restore = RAW.restore(images)
    kill(pid)
    row = Row(t_dump, stats.frozen_time / 1e6 if stats else 0.0, t_restore, dir_bytes(images))
    row.extra.update(sync_s=t_dump + t_sync, zstd_bytes=int(zstd))
    shutil.rmtree(images, ignore_errors=True)
    return row


def zstd_bytes(images: Path) -> int:
    """Bytes of ``tar -C images -cf - . | zstd -1 -T0``: the zstd CLI, or where it is missing
    (the GPU machine) the same level and all cores through the zstandard module."""
    if shutil.which("zstd"):
        out = subprocess.run(f"tar -C {images} -cf - . | zstd -1 -T0 -c | wc -c", shell=True,
                             capture_output=True, text=True, check=True).stdout
        return int(out)
    import zstandard

    tar = subprocess.Popen(["tar", "-C", str(images), "-cf", "-", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    total = 0
    compressor = zstandard.ZstdCompressor(level=1, threads=-1)
    for chunk in compressor.read_to_iter(tar.stdout, read_size=1 << 20):
        total += len(chunk)
    if tar.wait() != 0:
        raise SystemExit(f"tar -C {images} failed")
    return total


def stream(call: Any, field_name: str) -> Any:
    result = None
    for event in call:
        if event.WhichOneof("event") == field_name:
            result = getattr(event, field_name)
    return result


def via_grpc(mib: int, kind: str, work: Path, stub: Any, daemon: int, staging: list[Path]
             ) -> Row:
    pid = start_bigmem_of(mib, kind, work / "grpc.out")
    sampler = Sampler(daemon, staging)
    t0 = time.perf_counter()
    with sampler.running():
        ck = stream(stub.Dump(pb.DumpRequest(pid=pid), timeout=3600), "checkpoint")
    t_dump = time.perf_counter() - t0
    dump_rss, dump_staging = sampler.peak_rss - sampler.base_rss, sampler.peak_dir
    wait_gone(pid)
    sampler = Sampler(daemon, staging)
    t0 = time.perf_counter()
    with sampler.running():
        res = stream(stub.Restore(pb.RestoreRequest(checkpoint_id=ck.id), timeout=3600),
                     "result")
    t_restore = time.perf_counter() - t0
    kill(res.pid)
    stub.Delete(pb.DeleteRequest(id=ck.id), timeout=600)
    row = Row(t_dump, ck.frozen_s, t_restore, int(ck.bytes_new))
    row.extra.update(dump_rss=dump_rss, dump_staging=dump_staging,
                     restore_rss=sampler.peak_rss - sampler.base_rss,
                     restore_staging=sampler.peak_dir)
    return row


def via_cli(mib: int, kind: str, work: Path, sock: Path) -> Row:
    pid = start_bigmem_of(mib, kind, work / "cli.out")
    ctl = [*command_of("ckptctl", VENV), "--socket", str(sock), "--json"]
    t_dump, out = timed([*ctl, "dump", str(pid)])
    record = json.loads(out)
    wait_gone(pid)
    t_restore, out = timed([*ctl, "restore", record["id"]])
    kill(json.loads(out)["pid"])
    subprocess.run([*ctl, "delete", record["id"]], check=True, capture_output=True)
    return Row(t_dump, float(record.get("frozen_s", 0)), t_restore, int(record["bytes_new"]))


def conditions(when: str, meminfo: Path = Path("/proc/meminfo")) -> str:
    """What a small job's figure was measured under: the 1-minute load average, the bytes
    still waiting for writeback (a preceding big run's fsyncs and page cache slow a small
    job's own fsyncs) and what ran before it."""
    dirty_kib = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("Dirty:"):
                dirty_kib = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return (f"{when}, load average {os.getloadavg()[0]:.2f}, "
            f"{dirty_kib / 1024:.0f} MiB dirty awaiting writeback")


def start_small(out: Path) -> int:
    """A tiny job (``counter``, no extra memory: about CRIU's own zdtm test programs)."""
    return start_counter(out, steps=1000000, interval_ms=100, timeout=30)


def small_job(work: Path, sock: Path, rounds: int) -> dict[str, float]:
    """Issue 25's small job, medians of ``rounds``: raw ``criu dump``/``criu restore -d`` and
    ``ckptctl dump``/``ckptctl restore`` (CLI start-up included) of a tiny process."""
    import statistics

    ctl = [*command_of("ckptctl", VENV), "--socket", str(sock), "--json"]
    times: dict[str, list[float]] = {"raw dump": [], "raw restore": [], "ckptctl dump": [],
                                     "ckptctl restore": []}
    for _ in range(rounds):
        pid = start_small(work / "small.out")
        images = work / "small-images"
        times["raw dump"].append(RAW.dump(pid, images))
        wait_gone(pid)
        times["raw restore"].append(RAW.restore(images))
        kill(pid)
        wait_gone(pid)
        pid = start_small(work / "small.out")
        t, out = timed([*ctl, "dump", str(pid)])
        times["ckptctl dump"].append(t)
        record = json.loads(out)
        wait_gone(pid)
        t, out = timed([*ctl, "restore", record["id"]])
        times["ckptctl restore"].append(t)
        kill(json.loads(out)["pid"])
        subprocess.run([*ctl, "delete", record["id"]], check=True, capture_output=True)
    return {k: statistics.median(v) for k, v in times.items()}


def incremental(mib: int, work: Path, stub: Any) -> Row:
    pid = start_bigmem_of(mib, "mixed", work / "incr.out")
    t0 = time.perf_counter()
    full = stream(stub.Dump(pb.DumpRequest(pid=pid, leave_running=True), timeout=3600),
                  "checkpoint")
    t_full = time.perf_counter() - t0
    out = work / "incr.out"
    steps = out.read_text().count("\nstep")
    os.kill(pid, signal.SIGUSR1)  # 5% of the non-zero pages rewritten at the next step
    deadline = time.monotonic() + 30
    while out.read_text().count("\nstep") < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    second = stream(stub.Dump(pb.DumpRequest(pid=pid, leave_running=True), timeout=3600),
                    "checkpoint")
    t_incr = time.perf_counter() - t0
    kill(pid)
    for ck in (second, full):
        stub.Delete(pb.DeleteRequest(id=ck.id), timeout=600)
    changed = int(mib * 256 * 0.7 * 0.05) * PAGE  # 5% of the ~70% non-zero pages
    row = Row(t_incr, second.frozen_s, 0.0, int(second.bytes_new))
    row.extra.update(full_s=t_full, changed_bytes=changed)
    return row


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--kinds", default="mixed,random")
    ap.add_argument("--dir", default="", help="work directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--also", action="append", default=[], metavar="K=V",
                    help="one more daemon with this setting, side by side (repeatable)")
    ap.add_argument("--small", type=int, default=0, metavar="N",
                    help="also the small job (a tiny process) end to end, median of N")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    build_workloads()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-speed-", dir="/var/tmp"))
    results: dict[tuple[int, str], dict[str, Row]] = {}
    for mib in (int(s) for s in args.sizes.split(",") if s):
        for kind in args.kinds.split(","):
            print(f"{mib} MiB {kind}", file=sys.stderr)
            # a store of its own: bigmem's pages depend only on their index, so a shared store
            # would deduplicate one run against the previous ones
            with daemon_at(work / f"d-{mib}-{kind}") as (sock, pid, staging):
                stub = stub_at(sock)
                rows = {"raw": raw(mib, kind, work),
                        "grpc": via_grpc(mib, kind, work, stub, pid, staging)}
            # the CLI's run needs a store of its own too: bigmem's pages are the same in every
            # run, and the gRPC run's packs stay (deleted checkpoints' data waits for GC)
            with daemon_at(work / f"c-{mib}-{kind}") as (sock, pid, staging):
                rows["cli"] = via_cli(mib, kind, work, sock)
            for n, setting in enumerate(args.also):
                with daemon_at(work / f"d-{mib}-{kind}-{n}", setting) as (sock, pid, staging):
                    stub = stub_at(sock)
                    rows[f"grpc {setting}"] = via_grpc(mib, kind, work, stub, pid, staging)
            if kind == "mixed":
                with daemon_at(work / f"i-{mib}") as (sock, pid, staging):
                    stub = stub_at(sock)
                    rows["incr"] = incremental(mib, work, stub)
            results[(mib, kind)] = rows
    if args.small:
        before = conditions("after the sizes above" if results else "first in this run")
        with daemon_at(work / "small") as (sock, _pid, _staging):
            small = small_job(work, sock, args.small)
        report.say(f"\nsmall job, median of {args.small}: " + ", ".join(
            f"{k} {v:.3f} s" for k, v in small.items()) + " (target: ckptctl <= 0.15 s each)"
            + f"; measured {before}")
    if not results:
        return 0
    tables(results, report)
    shutil.rmtree(work, ignore_errors=True)
    return 0


ALSO_KEYS = {"stream_pages=false": "staged"}
"""The JSON key of an ``--also`` setting's table where the manual's plots read it."""

MIB = "{:,.0f}"


def tables(results: dict[tuple[int, str], dict[str, Row]], report: Report) -> None:
    mb: Callable[[float], float] = lambda b: b / 2**20  # noqa: E731
    report.units = {"time": "s", "size": "MiB"}
    size, kind = Col("size_gib", "size", "{:g} GiB"), Col("kind")
    main = report.table("speed", [
        size, kind, Col("raw_dump", "raw dump", "{:.2f}"),
        Col("raw_dump_sync", "raw dump+sync", "{:.2f}"),
        Col("raw_frozen", "raw frozen", "{:.2f}"), Col("raw_restore", "raw restore", "{:.2f}"),
        Col("zstd_mib", "zstd -1 MiB", MIB), Col("ckptd_dump", "gRPC dump", "{:.2f}"),
        Col("ckptd_frozen", "frozen", "{:.2f}"), Col("ckptd_restore", "restore", "{:.2f}"),
        Col("stored_mib", "stored MiB", MIB), Col("cli_dump", "CLI dump", "{:.2f}"),
        Col("cli_restore", "CLI restore", "{:.2f}"),
        Col("peak_rss_dump_mib", "peak RSS MiB dump", MIB),
        Col("peak_rss_restore_mib", "peak RSS MiB restore", MIB),
        Col("staging_dump_mib", "peak staging MiB dump", MIB),
        Col("staging_restore_mib", "peak staging MiB restore", MIB),
    ], note=f"kernel {os.uname().release}, {os.cpu_count()} CPUs, CRIU {CRIU}")
    for (mib, kind_), r in results.items():
        raw_, g, c = r["raw"], r["grpc"], r["cli"]
        main.add(mib / 1024, kind_, raw_.dump_s, raw_.extra["sync_s"], raw_.frozen_s,
                 raw_.restore_s, mb(raw_.extra["zstd_bytes"]), g.dump_s, g.frozen_s,
                 g.restore_s, mb(g.stored), c.dump_s, c.restore_s, mb(g.extra["dump_rss"]),
                 mb(g.extra["restore_rss"]), mb(g.extra["dump_staging"]),
                 mb(g.extra["restore_staging"]))
    report.show(main)
    settings = list(dict.fromkeys(key[5:] for r in results.values() for key in r
                                  if key.startswith("grpc ")))
    for setting in settings:
        other = report.table(ALSO_KEYS.get(setting, f"also {setting}"), [
            size, kind, Col("dump", fmt="{:.2f}"), Col("frozen", fmt="{:.2f}"),
            Col("restore", fmt="{:.2f}"), Col("stored_mib", "stored MiB", MIB),
            Col("peak_rss_dump_mib", "peak RSS MiB dump", MIB),
            Col("peak_rss_restore_mib", "peak RSS MiB restore", MIB),
            Col("staging_dump_mib", "peak staging MiB dump", MIB),
            Col("staging_restore_mib", "peak staging MiB restore", MIB),
        ], note=f"The same through gRPC with {setting} (a daemon of its own):")
        for (mib, kind_), r in results.items():
            o = r[f"grpc {setting}"]
            other.add(mib / 1024, kind_, o.dump_s, o.frozen_s, o.restore_s, mb(o.stored),
                      mb(o.extra["dump_rss"]), mb(o.extra["restore_rss"]),
                      mb(o.extra["dump_staging"]), mb(o.extra["restore_staging"]))
        report.show(other)
    ratios = report.table("ratios", [
        size, kind, Col("dump_vs_sync", "dump / (dump+sync) (<=1.0)", "{:.2f}x"),
        Col("dump_vs_raw", "dump / raw (<=1.5, goal 1.0)", "{:.2f}x"),
        Col("frozen_vs_raw", "frozen / raw (<=1.0)", "{:.2f}x"),
        Col("stored_vs_zstd", "stored / zstd -1 (<=1.0)", "{:.2f}x"),
        Col("restore_vs_raw", "restore / raw (<=1.0)", "{:.2f}x"),
        Col("incr_vs_full", "incr / full (<=0.3)", "{:.2f}"),
        Col("incr_bytes_vs_changed", "incr bytes / changed (<=1.2)", "{:.2f}"),
        Col("incr_vs_raw_dump", "incr / raw dump (<=1.1)", "{:.2f}x"),
        Col("incr_dump", "incr dump (s)", "{:.2f}"),
    ])
    for (mib, kind_), r in results.items():
        raw_, g = r["raw"], r["grpc"]
        inc = r.get("incr")
        incr = ((inc.dump_s / inc.extra["full_s"], inc.stored / inc.extra["changed_bytes"],
                 inc.dump_s / raw_.dump_s, inc.dump_s) if inc else (None, None, None, None))
        ratios.add(mib / 1024, kind_, g.dump_s / raw_.extra["sync_s"], g.dump_s / raw_.dump_s,
                   g.frozen_s / max(raw_.frozen_s, 1e-9), g.stored / raw_.extra["zstd_bytes"],
                   g.restore_s / raw_.restore_s, *incr)
    report.show(ratios)
    sizes = sorted({m for m, _ in results})
    if len(sizes) > 1:
        for kind_ in sorted({k for _, k in results}):
            small, big = results.get((sizes[0], kind_)), results.get((sizes[-1], kind_))
            if small and big:
                per_small = small["grpc"].dump_s / sizes[0]
                per_big = big["grpc"].dump_s / sizes[-1]
                report.say(f"\ncost growth ({kind_}): dump time per GiB at {sizes[-1]} MiB is "
                           f"{per_big / per_small:.2f}x that at {sizes[0]} MiB "
                           "(target <= 1.10x)")
