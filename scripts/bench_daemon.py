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
``--criu PATH`` (repeatable; default $CKPTD_CRIU or /usr/local/sbin/criu) compares CRIU
binaries in the same run: raw CRIU and a daemon of its own (``ckptd --criu PATH``) for each,
taken in turn within every round; ratios are against raw dump/restore of the same binary.
``--baseline TREE`` adds a daemon running the ckptd of another source tree (e.g. ``git archive
<commit> | tar -x -C /tmp/before``; PYTHONPATH) as the row ``ckptd-before``, in the same rounds.
``--restore-stream`` adds a daemon restoring with ``stream_restore = true`` (CRIU reads the
images from the store as they are verified) next to one with it false, and reports each
daemon's own restore time, its RSS growth and /dev/shm growth during restores.
Usage (root): .venv/bin/python scripts/bench_daemon.py [--mib 1024] [--repeat 3] [--criu PATH]...
                  [--stream] [--restore-stream] [--baseline /tmp/before]
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
import threading
import time
from pathlib import Path

from benchlib import CRIU, CRIU_FLAGS, dir_bytes, kill, timed, wait_gone

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "native" / "workloads" / "bin"
VENV = Path(sys.executable).parent


def start_workload(mib: int, out: Path) -> int:
    """Start the workload as a scheduler's launcher would; return its pid once memory is full.
    The pid is the launcher's ``$!`` (not a pgrep: another benchmark's workload may match)."""
    out.write_text("")
    pid = int(subprocess.run(
        ["setsid", "sh", "-c", f"exec {BIN}/counter --steps 0 --interval-ms 200 --mem-mib {mib} "
                     f"> {out} 2>&1 < /dev/null & echo $!"],
        check=True, capture_output=True, text=True,
    ).stdout)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if out.read_text().startswith("step"):
            return pid
        time.sleep(0.05)
    raise SystemExit("workload did not start")










def criu_version(criu: str) -> str:
    out = subprocess.run([criu, "--version"], capture_output=True, text=True, check=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Version:")), criu)


def run_raw(criu: str, mib: int, work: Path, sync: bool) -> tuple[float, float, int]:
    pid = start_workload(mib, work / "raw.out")
    images = work / "raw-images"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir()
    dump_cmd = [criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", *CRIU_FLAGS]
    if sync:
        dump_cmd = ["sh", "-c", " ".join(dump_cmd) + f" && sync -f {images}"]
    t_dump, _ = timed(dump_cmd)
    size = dir_bytes(images)
    wait_gone(pid)
    t_restore, _ = timed(
        [criu, "restore", "-D", str(images), "-d", "-o", "restore.log", *CRIU_FLAGS]
    )
    kill(pid)
    return t_dump, t_restore, size


RESTORE_EXTRA: dict[str, list[tuple[float, float, float]]] = {}
"""Per daemon: (the daemon's own restore time, its RSS growth during the restore in MiB,
the peak growth of /dev/shm's use during the restore in MiB) of each restore."""


def run_ckptd(mib: int, work: Path, sock: Path, daemon_pid: int = 0, name: str = ""
              ) -> tuple[float, float, int]:
    pid = start_workload(mib, work / "ckptd.out")
    ctl = [str(VENV / "ckptctl"), "--socket", str(sock), "--json"]
    t_dump, out = timed([*ctl, "dump", str(pid)])
    record = json.loads(out)
    wait_gone(pid)
    rss0 = reset_hwm(daemon_pid) if daemon_pid else 0.0
    with ShmPeak() as shm:
        t_restore, out = timed([*ctl, "restore", record["id"]])
    restored = json.loads(out)
    if daemon_pid:
        RESTORE_EXTRA.setdefault(name, []).append(
            (float(restored["duration_s"]), vm_hwm_mib(daemon_pid) - rss0, shm.peak_mib))
    kill(restored["pid"])
    subprocess.run([*ctl, "delete", record["id"]], check=True, capture_output=True)
    return t_dump, t_restore, int(record["bytes"])


def reset_hwm(pid: int) -> float:
    """Reset ``pid``'s peak RSS (VmHWM) to its RSS now; returns that RSS in MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    crius = args.criu or [CRIU]
    versions = {c: criu_version(c) for c in crius}
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "workloads")], check=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptd-bench-", dir="/var/tmp"))
    daemons: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    rows: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
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
                tag = f"{n}{path.removeprefix('ckptd')}"
                sock = work / f"ckptd{tag}.sock"
                log = (work / f"ckptd{tag}.log").open("w")
                extra = ["--config", str(work / configs[path])] if path in configs else []
                tree = Path(args.baseline).resolve() if path == "ckptd-before" else ROOT
                daemons[f"{criu} {path}"] = (subprocess.Popen(
                    [str(VENV / "ckptd"), "--socket", str(sock), "--store",
                     str(work / f"store{tag}"), "--state-dir", str(work / f"state{tag}"),
                     "--criu", criu, "--log-level", "WARNING", *extra],
                    stderr=log, env={**os.environ, "PYTHONPATH": str(tree)},
                ), sock)
        for _, sock in daemons.values():
            while not sock.exists():
                time.sleep(0.05)
        for i in range(args.repeat):
            print(f"round {i + 1}/{args.repeat}", file=sys.stderr)
            for criu in crius:
                for name in ("raw", "raw+sync", *paths):
                    if name.startswith("ckptd"):
                        daemon, sock = daemons[f"{criu} {name}"]
                        result = run_ckptd(args.mib, work, sock, daemon.pid, f"{criu} {name}")
                    else:
                        result = run_raw(criu, args.mib, work, sync=name == "raw+sync")
                    rows.setdefault((criu, name), []).append(result)
        peaks = {key: vm_hwm_mib(d.pid) for key, (d, _) in daemons.items()}
    finally:
        for daemon, _ in daemons.values():
            daemon.send_signal(signal.SIGTERM)
        for daemon, _ in daemons.values():
            daemon.wait(timeout=60)
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
    print(f"\nProcess of {args.mib} MiB (`counter --mem-mib {args.mib}`), median of "
          f"{args.repeat}; kernel {os.uname().release}, {os.cpu_count()} CPUs\n")
    many = len(crius) > 1
    print(f"| path{' | CRIU' if many else ''} | dump (s) | dump vs raw | restore (s) "
          "| restore vs raw | image bytes |")
    print(f"|---{'|---' if many else ''}|---:|---:|---:|---:|---:|")
    for (criu, name), (d, r, b) in med.items():
        raw_d, raw_r = med[(criu, "raw")][0], med[(criu, "raw")][1]
        col = f" | {versions[criu]}" if many else ""
        print(f"| {name}{col} | {d:.3f} | {d / raw_d:.2f}x | {r:.3f} | {r / raw_r:.2f}x "
              f"| {int(b):,} |")
    if many:
        base = crius[0]
        print(f"\nAgainst CRIU {versions[base]} ({base}), same path:\n")
        print("| path | CRIU | dump | restore |")
        print("|---|---|---:|---:|")
        for (criu, name), (d, r, _) in med.items():
            if criu != base:
                bd, br = med[(base, name)][0], med[(base, name)][1]
                print(f"| {name} | {versions[criu]} | {d / bd:.2f}x | {r / br:.2f}x |")
    print("\nPeak RSS of each daemon over the whole run (VmHWM): "
          + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items()))
    print("\nRestores, median (max) over the rounds: the daemon's own time until the tree "
          "runs (no ckptctl start-up), the daemon's RSS growth during the restore, /dev/shm "
          "staging growth\n")
    print("| daemon | restore in daemon (s) | vs raw criu restore | RSS growth MiB "
          "| /dev/shm MiB |")
    print("|---|---:|---:|---:|---:|")
    for key, runs in RESTORE_EXTRA.items():
        criu = key.split(" ", 1)[0]
        dur = statistics.median(r[0] for r in runs)
        print(f"| {key} | {dur:.3f} | {dur / med[(criu, 'raw')][1]:.2f}x "
              f"| {statistics.median(r[1] for r in runs):.0f} ({max(r[1] for r in runs):.0f}) "
              f"| {statistics.median(r[2] for r in runs):.0f} ({max(r[2] for r in runs):.0f}) |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
