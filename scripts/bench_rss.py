#!/usr/bin/env python3
"""The daemon's resident memory over many small dumps (issue 21: RSS grew 64 -> 327 MB over
80 small dumps, glibc's per-thread malloc arenas keeping what each dump had freed). A script
you run, not a test.

One daemon (its own store, state and socket under --dir), one small `counter` process
(--mem-mib MiB), then --dumps leave-running dumps of it through the gRPC API from this
process, one after the other. The daemon's VmRSS (/proc/PID/status) is read when it serves,
after the first dump, every --every dumps, and at the end; VmHWM is its peak.

Usage (root): .venv/bin/python scripts/bench_rss.py [--dumps 40] [--mem-mib 16] [--dir DIR]
              [--env K=V ...] (environment of the daemon, e.g. MALLOC_ARENA_MAX=8)
Prints one line per reading and a Markdown summary row.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import kill

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = ROOT / "native" / "workloads" / "bin"
VENV = Path(sys.executable).parent

import grpc  # noqa: E402

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb  # noqa: E402
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc as pb_grpc  # noqa: E402


def status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_daemon(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    sock = root / "ckptd.sock"
    log = (root / "ckptd.log").open("w")
    daemon = subprocess.Popen(
        [str(VENV / "ckptd"), "--socket", str(sock), "--store", str(root / "store"),
         "--state-dir", str(root / "state"), "--log-level", "WARNING", "--jobs-cgroup", ""],
        stderr=log, stdout=log, stdin=subprocess.DEVNULL, env={**os.environ, **env})
    while not sock.exists():
        if daemon.poll() is not None:
            raise SystemExit(f"ckptd exited: see {root / 'ckptd.log'}")
        time.sleep(0.05)
    return daemon, sock


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dumps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--mem-mib", type=int, default=16)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--env", action="append", default=[], help="K=V for the daemon")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (the daemon and CRIU need it)")
    env = dict(kv.split("=", 1) for kv in args.env)
    root = Path(tempfile.mkdtemp(prefix="bench-rss-", dir=args.dir))
    daemon, sock = start_daemon(root, env)
    out = (root / "job.out").open("w")
    job = subprocess.Popen(
        [str(BIN / "counter"), "--steps", "0", "--interval-ms", "50",
         "--mem-mib", str(args.mem_mib)],
        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
        start_new_session=True)
    readings: list[tuple[str, float]] = []
    try:
        time.sleep(1.0)
        with grpc.insecure_channel(f"unix:{sock}") as channel:
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
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    for what, mib in readings:
        print(f"{what:>18}: VmRSS {mib:7.1f} MiB")
    first, last = readings[0][1], readings[-1][1]
    print(f"{'peak':>18}: VmHWM {peak:7.1f} MiB; {args.dumps} dumps in {took:.1f}s")
    env_text = " ".join(args.env) or "default"
    print(f"\n| daemon env | dumps | RSS serving | RSS after 1 | RSS at end | growth | peak |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {env_text} | {args.dumps} | {first:.0f} MiB | {readings[1][1]:.0f} MiB | "
          f"{last:.0f} MiB | +{last - first:.0f} MiB | {peak:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
