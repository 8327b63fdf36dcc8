"""Benchmark: what the daemon adds over running CRIU directly (a script you run, not a test).

For a process of about N MiB (default 1024: `counter --mem-mib N`, every page written), in
one run, side by side, repeated R times (median reported):

  raw   `criu dump -t PID -D DIR` (kills the process), `criu restore -D DIR -d`
  raw+sync   the same dump followed by `sync -f DIR` (ckptd makes a checkpoint durable
             before it is listed; raw CRIU does not)
  ckptd      `ckptctl dump PID`, `ckptctl restore PID` through a running daemon

Times are wall-clock, from the command's start to its exit, as a user sees them. Restore ends
when the command returns (the process runs). Prints a Markdown table with ratios.
``--criu PATH`` (repeatable; default $CKPTD_CRIU or /usr/local/sbin/criu) compares CRIU
binaries in the same run: raw CRIU and a daemon of its own (``ckptd --criu PATH``) for each,
taken in turn within every round; ratios are against raw dump/restore of the same binary.
``--baseline TREE`` adds a daemon running the ckptd of another source tree (e.g. ``git archive
<commit> | tar -x -C /tmp/before``; PYTHONPATH) as the row ``ckptd-before``, in the same rounds.
``--restore-stream`` adds a daemon restoring with ``stream_restore = true`` (CRIU reads the
images from the store as they are verified) next to one with it false, and reports each
daemon's own restore time, its RSS growth and /dev/shm growth during restores.
Usage (root): .venv/bin/python -m bench daemon [--mib 1024] [--repeat 3] [--criu PATH]...
                  [--stream] [--restore-stream] [--baseline /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench.common import (
    CRIU,
    ROOT,
    Daemon,
    RawCriu,
    build_workloads,
    criu_version,
    dir_bytes,
    kill,
    need_root,
    start_counter,
    status_mib,
    timed,
    wait_gone,
)
from bench.report import Col, Report

Restores = dict[str, list[tuple[float, float, float]]]
"""Per daemon: (the daemon's own restore time, its RSS growth during the restore in MiB,
the peak growth of /dev/shm's use during the restore in MiB) of each restore."""


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="", help="work directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--criu", action="append", default=[],
                    help=f"CRIU binary (repeatable: compared side by side; default {CRIU})")
    ap.add_argument("--stream", action="store_true",
                    help="also a daemon with stream_pages = true for each CRIU (ckptd-stream)")
    ap.add_argument("--baseline", default="", help="another ckptd source tree (ckptd-before)")
    ap.add_argument("--restore-stream", action="store_true",
                    help="ckptd with stream_restore = false, and a daemon with it true for "
                         "each CRIU (ckptd-rstream; needs CRIU's rpc_stream patch)")


def run_raw(criu: str, mib: int, work: Path, sync: bool) -> tuple[float, float, int]:
    raw = RawCriu(criu)
    pid = start_counter(work / "raw.out", mib=mib)
    images = work / "raw-images"
    t_dump = raw.dump(pid, images)
    if sync:
        t_dump += raw.sync(images)
    size = dir_bytes(images)
    wait_gone(pid)
    t_restore = raw.restore(images)
    kill(pid)
    return t_dump, t_restore, size


def run_ckptd(mib: int, work: Path, daemon: Daemon, name: str, restores: Restores
              ) -> tuple[float, float, int]:
    pid = start_counter(work / "ckptd.out", mib=mib)
    t_dump, out = timed([*daemon.ctl, "dump", str(pid)])
    record = json.loads(out)
    wait_gone(pid)
    rss0 = reset_hwm(daemon.pid)
    with ShmPeak() as shm:
        t_restore, out = timed([*daemon.ctl, "restore", record["id"]])
    restored = json.loads(out)
    restores.setdefault(name, []).append(
        (float(restored["duration_s"]), status_mib(daemon.pid, "VmHWM") - rss0, shm.peak_mib))
    kill(restored["pid"])
    subprocess.run([*daemon.ctl, "delete", record["id"]], check=True, capture_output=True)
    return t_dump, t_restore, int(record["bytes"])


def reset_hwm(pid: int) -> float:
    """Reset ``pid``'s peak RSS (VmHWM) to its RSS now; returns that RSS in MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_mib(pid, "VmRSS")


class ShmPeak:
    """The peak growth of /dev/shm's use (a daemon's RAM-backed staging) while inside."""

    def __init__(self) -> None:
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _poll(self) -> None:
        base = self._used()
        while not self._stop.wait(0.01):
            self.peak_mib = max(self.peak_mib, (self._used() - base) / 2**20)

    def __enter__(self) -> ShmPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    crius = args.criu or [CRIU]
    versions = {c: criu_version(c) for c in crius}
    build_workloads()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-", dir="/var/tmp"))
    daemons: dict[str, Daemon] = {}
    rows: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    restores: Restores = {}
    try:
        (work / "stream.toml").write_text("stream_pages = true\n")
        (work / "ckptd.toml").write_text("stream_restore = false\n")
        (work / "rstream.toml").write_text("stream_restore = true\n")
        paths = ["ckptd", "ckptd-stream"] if args.stream else ["ckptd"]
        paths += ["ckptd-rstream"] if args.restore_stream else []
        paths += ["ckptd-before"] if args.baseline else []
        configs = {"ckptd-stream": "stream.toml", "ckptd-rstream": "rstream.toml"}
        if args.restore_stream:
            configs["ckptd"] = "ckptd.toml"
        for n, criu in enumerate(crius):
            for path in paths:
                extra = ("--config", str(work / configs[path])) if path in configs else ()
                tree = Path(args.baseline).resolve() if path == "ckptd-before" else ROOT
                daemons[f"{criu} {path}"] = Daemon(
                    work / f"d{n}{path.removeprefix('ckptd')}", tree=tree,
                    args=("--criu", criu, *extra))
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat}", file=sys.stderr)
            for criu in crius:
                for name in ("raw", "raw+sync", *paths):
                    if name.startswith("ckptd"):
                        key = f"{criu} {name}"
                        result = run_ckptd(args.mib, work, daemons[key], key, restores)
                    else:
                        result = run_raw(criu, args.mib, work, sync=name == "raw+sync")
                    rows.setdefault((criu, name), []).append(result)
        peaks = {key: status_mib(d.pid, "VmHWM") for key, d in daemons.items()}
    finally:
        for daemon in daemons.values():
            daemon.stop()
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
    report.units = {"time": "s", "bytes": "bytes"}
    many = len(crius) > 1
    table = report.table("daemon", [
        Col("path"), *([Col("criu", "CRIU")] if many else []),
        Col("dump", "dump (s)", "{:.3f}"), Col("dump_vs_raw", "dump vs raw", "{:.2f}x"),
        Col("restore", "restore (s)", "{:.3f}"),
        Col("restore_vs_raw", "restore vs raw", "{:.2f}x"),
        Col("image_bytes", "image bytes", "{:,}"),
    ], note=f"Process of {args.mib} MiB (`counter --mem-mib {args.mib}`), median of "
            f"{args.repeat}; kernel {os.uname().release}, {os.cpu_count()} CPUs")
    for (criu, name), (d, r, b) in med.items():
        raw_d, raw_r = med[(criu, "raw")][0], med[(criu, "raw")][1]
        table.add(name, *([versions[criu]] if many else []), d, d / raw_d, r, r / raw_r,
                  int(b))
    report.show(table)
    if many:
        base = crius[0]
        against = report.table("criu_versions", [
            Col("path"), Col("criu", "CRIU"), Col("dump", fmt="{:.2f}x"),
            Col("restore", fmt="{:.2f}x"),
        ], note=f"Against CRIU {versions[base]} ({base}), same path:")
        for (criu, name), (d, r, _) in med.items():
            if criu != base:
                bd, br = med[(base, name)][0], med[(base, name)][1]
                against.add(name, versions[criu], d / bd, r / br)
        report.show(against)
    report.say("\nPeak RSS of each daemon over the whole run (VmHWM): "
               + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items()))
    inside = report.table("restore_stream", [
        Col("daemon"), Col("restore_in_daemon", "restore in daemon (s)", "{:.3f}"),
        Col("vs_raw", "vs raw criu restore", "{:.2f}x"),
        Col("rss_growth_mib", "RSS growth MiB", "{}"), Col("shm_mib", "/dev/shm MiB", "{}"),
    ], note="Restores, median (max) over the rounds: the daemon's own time until the tree "
            "runs (no ckptctl start-up), the daemon's RSS growth during the restore, "
            "/dev/shm staging growth")
    for key, runs in restores.items():
        criu = key.split(" ", 1)[0]
        dur = statistics.median(r[0] for r in runs)
        inside.add(key, dur, dur / med[(criu, "raw")][1],
                   f"{statistics.median(r[1] for r in runs):.0f} ({max(r[1] for r in runs):.0f})",
                   f"{statistics.median(r[2] for r in runs):.0f} ({max(r[2] for r in runs):.0f})")
    report.show(inside)
    shutil.rmtree(work, ignore_errors=True)
    return 0
