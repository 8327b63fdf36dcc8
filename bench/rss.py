"""The daemon's resident memory over many small dumps (issue 21: RSS grew 64 -> 327 MB over
80 small dumps, glibc's per-thread malloc arenas keeping what each dump had freed). A script
you run, not a test.

One daemon (its own store, state and socket under --dir), one small `counter` process
(--mem-mib MiB), then --dumps leave-running dumps of it through the gRPC API from this
process, one after the other. The daemon's VmRSS (/proc/PID/status) is read when it serves,
after the first dump, every --every dumps, and at the end; VmHWM is its peak.

Usage (root): .venv/bin/python -m bench rss [--dumps 40] [--mem-mib 16] [--dir DIR]
              [--env K=V ...] (environment of the daemon, e.g. MALLOC_ARENA_MAX=8)
Prints one line per reading and a Markdown summary row.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import BIN, Daemon, kill, need_root, status_mib
from bench.report import Col, Report
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc as pb_grpc


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dumps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--mem-mib", type=int, default=16)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--env", action="append", default=[], help="K=V for the daemon")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    env = dict(kv.split("=", 1) for kv in args.env)
    root = Path(tempfile.mkdtemp(prefix="bench-rss-", dir=args.dir))
    daemon = Daemon(root, args=("--jobs-cgroup", ""), env=env)
    out = (root / "job.out").open("w")
    job = subprocess.Popen(
        [str(BIN / "counter"), "--steps", "0", "--interval-ms", "50",
         "--mem-mib", str(args.mem_mib)],
        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
        start_new_session=True)
    readings: list[tuple[str, float]] = []
    try:
        time.sleep(1.0)
        with grpc.insecure_channel(f"unix:{daemon.sock}") as channel:
            stub = pb_grpc.CheckpointerStub(channel)  # type: ignore[no-untyped-call]
            stub.List(pb.ListRequest(), timeout=60)  # the daemon has served one call
            readings.append(("serving", status_mib(daemon.pid, "VmRSS")))
            started = time.monotonic()
            for i in range(1, args.dumps + 1):
                for event in stub.Dump(pb.DumpRequest(pid=job.pid, leave_running=True),
                                       timeout=120):
                    if event.WhichOneof("event") == "checkpoint":
                        break
                if i == 1 or i % args.every == 0 or i == args.dumps:
                    readings.append((f"after {i} dumps", status_mib(daemon.pid, "VmRSS")))
            took = time.monotonic() - started
        peak = status_mib(daemon.pid, "VmHWM")
    finally:
        kill(job.pid)
        daemon.stop()
    for what, mib in readings:
        print(f"{what:>18}: VmRSS {mib:7.1f} MiB")
    first, last = readings[0][1], readings[-1][1]
    report.say(f"{'peak':>18}: VmHWM {peak:7.1f} MiB; {args.dumps} dumps in {took:.1f}s")
    report.units = {"rss": "MiB"}
    table = report.table("rss", [
        Col("env", "daemon env"), Col("dumps"), Col("serving", "RSS serving", "{:.0f} MiB"),
        Col("after_1", "RSS after 1", "{:.0f} MiB"), Col("at_end", "RSS at end", "{:.0f} MiB"),
        Col("growth", fmt="+{:.0f} MiB"), Col("peak", fmt="{:.0f} MiB"),
    ])
    table.add(" ".join(args.env) or "default", args.dumps, first, readings[1][1], last,
              last - first, peak)
    report.show(table)
    return 0
