"""Benchmark: what capturing the files a job writes costs (a script you run, not a test).

A small job (a Python process) keeps a log of N MiB open for appending (default 2048). In one
run, side by side, through a running daemon, each a leave-running checkpoint:

  no file     the same job without the log open (the baseline: what CRIU alone costs)
  first       the job with its N MiB log: the whole log is captured (new to the store)
  +10 KiB     after the job appended 10 KiB: only the pages that changed are new

Reports frozen time, total dump time and new bytes in the store; then a restore after the log
grew further (the put-back: truncation only, the newer version copied aside).
Usage (root): .venv/bin/python -m bench files [--mib 2048] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Daemon, kill, need_root, timed, wait_gone
from bench.report import Col, Report

JOB = """
import os, sys, time
log = open(sys.argv[1], "ab") if sys.argv[1] != "-" else None
print("ready", flush=True)
for line in sys.stdin:
    if log is not None:
        log.write(os.urandom(10 * 1024)); log.flush()
    print("appended", flush=True)
"""


class Job:
    def __init__(self, log: str, work: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", JOB, log], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True, cwd=work, text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "ready\n"

    def append(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "appended\n"


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--dir", default="/var/tmp", help="where the log and the store go")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-files-", dir=args.dir))
    rows: list[tuple[str, float, float, int]] = []
    with Daemon(work) as daemon:
        ctl = daemon.ctl
        log = work / "train.log"
        with open(log, "wb") as f:  # incompressible, like a real log's worth of pages
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        base = Job("-", work)
        t, out = timed([*ctl, "dump", str(base.proc.pid), "--leave-running"])
        rec = json.loads(out)
        rows.append(("no file (baseline)", rec["frozen_s"], t, rec["bytes_new"]))
        kill(base.proc.pid)

        job = Job(str(log), work)
        t, out = timed([*ctl, "dump", str(job.proc.pid), "--leave-running"])
        rec = json.loads(out)
        rows.append((f"first, {args.mib} MiB log", rec["frozen_s"], t, rec["bytes_new"]))
        job.append()
        t, out = timed([*ctl, "dump", str(job.proc.pid), "--leave-running"])
        rec = json.loads(out)
        rows.append(("after +10 KiB", rec["frozen_s"], t, rec["bytes_new"]))
        job.append()
        job.append()
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        wait_gone(job.proc.pid)
        t_restore, out = timed([*ctl, "restore", rec["id"]])
        restored = json.loads(out)
        kill(restored["pid"])
    report.units = {"time": "s", "bytes": "bytes"}
    table = report.table("files", [
        Col("checkpoint"), Col("frozen", "frozen (s)", "{:.3f}"),
        Col("dump", "dump (s)", "{:.3f}"), Col("bytes_new", "new bytes in the store", "{:,}"),
    ], note=f"Leave-running checkpoints of a job appending to a {args.mib} MiB log "
            f"(kernel {os.uname().release}, {os.cpu_count()} CPUs, store on {args.dir})")
    for row in rows:
        table.add(*row)
    report.show(table)
    report.say(f"\nrestore after +20 KiB more (put back: truncate, copy the newer log aside): "
               f"{t_restore:.3f} s, kept {restored['files_kept']}")
    shutil.rmtree(work, ignore_errors=True)
    return 0
