#!/usr/bin/env python3
"""Benchmark: what the daemon adds over running CRIU directly (a script you run, not a test).

For a process of about N MiB (default 1024: `counter --mem-mib N`, every page written), in
one run, side by side, repeated R times (median reported):

  raw   `criu dump -t PID -D DIR` (kills the process), `criu restore -D DIR -d`
  raw+sync   the same dump followed by `sync -f DIR` (ckptd makes a checkpoint durable
             before it is listed; raw CRIU does not)
  ckptd      `ckptctl dump PID`, `ckptctl restore PID` through a running daemon

Times are wall-clock, from the command's start to its exit, as a user sees them. Restore ends
when the command returns (the process runs). Prints a Markdown table with ratios.
Usage (root): .venv/bin/python scripts/bench_daemon.py [--mib 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import CRIU, CRIU_FLAGS, dir_bytes, kill, timed, wait_gone

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "native" / "workloads" / "bin"
VENV = Path(sys.executable).parent


def start_workload(mib: int, out: Path) -> int:
    """Start the workload as a scheduler's launcher would; return its pid once memory is full."""
    out.write_text("")
    subprocess.run(
        ["setsid", "sh", "-c", f"exec {BIN}/counter --steps 0 --interval-ms 200 --mem-mib {mib} "
                     f"> {out} 2>&1 < /dev/null &"],
        check=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if out.read_text().startswith("step"):
            pids = subprocess.run(
                ["pgrep", "-n", "-f", f"counter --steps 0 --interval-ms 200 --mem-mib {mib}"],
                capture_output=True, text=True, check=True,
            ).stdout.split()
            return int(pids[0])
        time.sleep(0.05)
    raise SystemExit("workload did not start")










def run_raw(mib: int, work: Path, sync: bool) -> tuple[float, float, int]:
    pid = start_workload(mib, work / "raw.out")
    images = work / "raw-images"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir()
    dump_cmd = [CRIU, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", *CRIU_FLAGS]
    if sync:
        dump_cmd = ["sh", "-c", " ".join(dump_cmd) + f" && sync -f {images}"]
    t_dump, _ = timed(dump_cmd)
    size = dir_bytes(images)
    wait_gone(pid)
    t_restore, _ = timed(
        [CRIU, "restore", "-D", str(images), "-d", "-o", "restore.log", *CRIU_FLAGS]
    )
    kill(pid)
    return t_dump, t_restore, size


def run_ckptd(mib: int, work: Path, sock: Path) -> tuple[float, float, int]:
    pid = start_workload(mib, work / "ckptd.out")
    ctl = [str(VENV / "ckptctl"), "--socket", str(sock), "--json"]
    t_dump, out = timed([*ctl, "dump", str(pid)])
    record = json.loads(out)
    wait_gone(pid)
    t_restore, out = timed([*ctl, "restore", record["id"]])
    kill(json.loads(out)["pid"])
    subprocess.run([*ctl, "delete", record["id"]], check=True, capture_output=True)
    return t_dump, t_restore, int(record["bytes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="", help="work directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--stream", action="store_true",
                    help="also a daemon with stream_pages = true (row ckptd-stream)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "workloads")], check=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-", dir="/var/tmp"))
    sock = work / "ckptd.sock"
    log = (work / "ckptd.log").open("w")
    daemon = subprocess.Popen(
        [str(VENV / "ckptd"), "--socket", str(sock), "--store", str(work / "store"),
         "--state-dir", str(work / "state"), "--log-level", "WARNING"],
        stderr=log,
    )
    streaming = None
    stream_sock = work / "ckptd-stream.sock"
    if args.stream:
        (work / "stream.toml").write_text("stream_pages = true\n")
        streaming = subprocess.Popen(
            [str(VENV / "ckptd"), "--socket", str(stream_sock), "--store",
             str(work / "store-stream"), "--state-dir", str(work / "state-stream"),
             "--config", str(work / "stream.toml"), "--log-level", "WARNING"],
            stderr=log,
        )
    try:
        while not sock.exists() or (streaming is not None and not stream_sock.exists()):
            time.sleep(0.05)
        rows: dict[str, list[tuple[float, float, int]]] = {"raw": [], "raw+sync": [], "ckptd": []}
        if streaming is not None:
            rows["ckptd-stream"] = []
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat}", file=sys.stderr)
            rows["raw"].append(run_raw(args.mib, work, sync=False))
            rows["raw+sync"].append(run_raw(args.mib, work, sync=True))
            rows["ckptd"].append(run_ckptd(args.mib, work, sock))
            if streaming is not None:
                rows["ckptd-stream"].append(run_ckptd(args.mib, work, stream_sock))
        peaks = {name: vm_hwm_mib(d.pid) for name, d in (("ckptd", daemon),
                                                           ("ckptd-stream", streaming)) if d}
    finally:
        for d in (daemon, streaming):
            if d is not None:
                d.send_signal(signal.SIGTERM)
                d.wait(timeout=60)
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
    raw_d, raw_r = med["raw"][0], med["raw"][1]
    print(f"\nProcess of {args.mib} MiB (`counter --mem-mib {args.mib}`), median of "
          f"{args.repeat}; kernel {os.uname().release}, {os.cpu_count()} CPUs\n")
    print("| path | dump (s) | dump vs raw | restore (s) | restore vs raw | image bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (d, r, b) in med.items():
        print(f"| {name} | {d:.3f} | {d / raw_d:.2f}x | {r:.3f} | {r / raw_r:.2f}x | {int(b):,} |")
    print("\nPeak RSS of each daemon over the whole run (VmHWM): "
          + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items()))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
