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

``--baseline TREE`` adds a row for a second daemon running the ckptd of another source tree
(e.g. ``git archive <commit> | tar -x -C /tmp/before``), each with its own store, in the
same rounds: before and after side by side, in one run. The daemon of this tree runs this
tree's code (PYTHONPATH), whatever the venv has installed.
Usage (root): .venv/bin/python scripts/bench_daemon.py [--mib 1024] [--repeat 3]
                  [--baseline /tmp/before]
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


class Ckptd:
    """A daemon (and its ckptctl) running the ckptd of one source tree, with its own store."""

    def __init__(self, tree: Path, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(tree)}
        sock = work / "ckptd.sock"
        self.ctl = [str(VENV / "ckptctl"), "--socket", str(sock), "--json"]
        self.log = (work / "ckptd.log").open("w")
        self.proc = subprocess.Popen(
            [str(VENV / "ckptd"), "--socket", str(sock), "--store", str(work / "store"),
             "--state-dir", str(work / "state"), "--log-level", "WARNING"],
            stderr=self.log, env=self.env,
        )
        while not sock.exists():
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def run_ckptd(mib: int, work: Path, d: Ckptd) -> tuple[float, float, int]:
    pid = start_workload(mib, work / "ckptd.out")
    t_dump, out = timed([*d.ctl, "dump", str(pid)], env=d.env)
    record = json.loads(out)
    wait_gone(pid)
    t_restore, out = timed([*d.ctl, "restore", record["id"]], env=d.env)
    kill(json.loads(out)["pid"])
    subprocess.run([*d.ctl, "delete", record["id"]], check=True, capture_output=True, env=d.env)
    return t_dump, t_restore, int(record["bytes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="", help="work directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--baseline", default="", help="another ckptd source tree to compare with")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "workloads")], check=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-", dir="/var/tmp"))
    daemons: dict[str, Ckptd] = {}
    rows: dict[str, list[tuple[float, float, int]]] = {"raw": [], "raw+sync": []}
    try:
        if args.baseline:
            daemons["ckptd before"] = Ckptd(Path(args.baseline).resolve(), work / "before")
        daemons["ckptd"] = Ckptd(ROOT, work / "this")
        rows.update({name: [] for name in daemons})
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat}", file=sys.stderr)
            rows["raw"].append(run_raw(args.mib, work, sync=False))
            rows["raw+sync"].append(run_raw(args.mib, work, sync=True))
            for name, d in daemons.items():
                rows[name].append(run_ckptd(args.mib, work, d))
    finally:
        for d in daemons.values():
            d.stop()
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
    raw_d, raw_r = med["raw"][0], med["raw"][1]
    print(f"\nProcess of {args.mib} MiB (`counter --mem-mib {args.mib}`), median of "
          f"{args.repeat}; kernel {os.uname().release}, {os.cpu_count()} CPUs"
          + (f"; before: {args.baseline}" if args.baseline else "") + "\n")
    print("| path | dump (s) | dump vs raw | restore (s) | restore vs raw | image bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (d, r, b) in med.items():
        print(f"| {name} | {d:.3f} | {d / raw_d:.2f}x | {r:.3f} | {r / raw_r:.2f}x | {int(b):,} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
