#!/usr/bin/env python3
"""Migration of a 1 GiB job between two daemons, against the raw CRIU baseline, in one run.

Two ckptd daemons on loopback (each its own store, mutual TLS from scripts/make-peer-certs.sh)
move `counter --mem-mib N` (N MiB of incompressible memory, one page rewritten per step)
A -> B, let it run a few seconds, then B -> A. Reported per migration: bytes sent, wall time
of `ckptctl migrate`, and the job's downtime (from its freeze to running on the target), then
where the downtime went, per step (from the source daemon's log).

Baseline, the same job by hand: `criu dump` -> `tar | zstd -1 -T0 | zstd -d | tar -x` into a
second directory (the pipe stands for the network) -> `criu restore`: every migration moves
everything.

Usage (root): .venv/bin/python scripts/bench_migrate.py [--mib 1024] [--pause 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import CRIU, kill, timed, wait_gone

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv" / "bin"
BIN = ROOT / "native" / "workloads" / "bin"
CRIU_FLAGS = ["--shell-job"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_workload(mib: int, out: Path) -> int:
    out.write_text("")
    pid = subprocess.run(
        ["setsid", "sh", "-c", f'{BIN}/counter --steps 0 --interval-ms 200 --mem-mib {mib} '
                               f'> {out} 2>&1 < /dev/null & echo $!'],
        check=True, capture_output=True, text=True,
    ).stdout.split()[0]
    deadline = time.monotonic() + 120
    while not out.read_text().startswith("step"):
        if time.monotonic() > deadline:
            raise SystemExit("workload did not start")
        time.sleep(0.05)
    return int(pid)


def raw_move(pid: int, work: Path) -> tuple[float, int]:
    """criu dump, compressed copy through a pipe, criu restore: (seconds, bytes moved)."""
    src, dst = work / "raw-src", work / "raw-dst"
    for d in (src, dst):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    start = time.monotonic()
    timed([CRIU, "dump", "-t", str(pid), "-D", str(src), "-o", "dump.log", *CRIU_FLAGS])
    wait_gone(pid)
    size_file = work / "raw-bytes"
    subprocess.run(
        ["sh", "-c", f"tar -C {src} -cf - . | zstd -q -1 -T0 | tee >(wc -c > {size_file}) "
                     f"| zstd -q -d | tar -C {dst} -xf -"],
        check=True, executable="/bin/bash",
    )
    timed([CRIU, "restore", "-D", str(dst), "-d", "-o", "restore.log", *CRIU_FLAGS])
    elapsed = time.monotonic() - start
    time.sleep(0.2)
    return elapsed, int(size_file.read_text().split()[0] or 0)


def daemon(work: Path, name: str, pki: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    root = work / name
    root.mkdir()
    sock = root / "ckptd.sock"
    address = f"127.0.0.1:{free_port()}"
    conf = root / "ckptd.toml"
    conf.write_text(
        f'node = "{name}"\npeer_listen = "{address}"\ntls_cert = "{pki}/{name}.pem"\n'
        f'tls_key = "{pki}/{name}.key"\ntls_ca = "{pki}/ca.pem"\n'
    )
    proc = subprocess.Popen(
        [str(VENV / "ckptd"), "--socket", str(sock), "--store", str(root / "store"),
         "--config", str(conf), "--log-level", "INFO", "--criu", CRIU],
        stderr=(root / "ckptd.log").open("w"),
    )
    while not sock.exists():
        if proc.poll() is not None:
            raise SystemExit((root / "ckptd.log").read_text())
        time.sleep(0.05)
    return proc, sock, address


def migrate(sock: Path, pid: int, to: str) -> tuple[float, dict[str, object]]:
    t, out = timed([str(VENV / "ckptctl"), "--socket", str(sock), "--json", "migrate",
                    str(pid), "--to", to])
    return t, json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--pause", type=float, default=5.0, help="seconds on B before moving back")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "workloads")], check=True)
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-migrate-", dir="/var/tmp"))
    pki = work / "pki"
    subprocess.run(["bash", str(ROOT / "scripts" / "make-peer-certs.sh"), str(pki),
                    "a=127.0.0.1", "b=127.0.0.1"], check=True, capture_output=True)
    procs = []
    try:
        # baseline: two full moves (raw CRIU has nothing incremental)
        pid = start_workload(args.mib, work / "raw.out")
        raw = [raw_move(pid, work)]
        time.sleep(args.pause)
        raw.append(raw_move(pid, work))
        kill(pid)
        wait_gone(pid)

        a, sock_a, addr_a = daemon(work, "a", pki)
        b, sock_b, addr_b = daemon(work, "b", pki)
        procs = [a, b]
        pid = start_workload(args.mib, work / "ckptd.out")
        t1, first = migrate(sock_a, pid, addr_b)
        time.sleep(args.pause)
        t2, second = migrate(sock_b, pid, addr_a)
        kill(pid)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)
    print(f"\n{args.mib} MiB job (`counter --mem-mib {args.mib}`: incompressible memory, one "
          f"page rewritten per 200 ms step), {args.pause:g} s on B between the moves; loopback, "
          f"kernel {os.uname().release}, {os.cpu_count()} CPUs\n")
    print("| migration | path | bytes sent | vs raw | wall (s) | downtime (s) | vs raw |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, (t, res), (t_raw, b_raw) in (
        ("1st (A->B)", (t1, first), raw[0]), ("2nd (B->A)", (t2, second), raw[1])
    ):
        sent = int(str(res["bytes_sent"]))
        down = float(str(res["downtime_s"]))
        print(f"| {label} | raw criu + zstd -1 -T0 | {b_raw:,} | 1.00x | {t_raw:.2f} | "
              f"{t_raw:.2f} | 1.00x |")
        print(f"| {label} | ckptctl migrate | {sent:,} | {sent / b_raw:.3f}x | {t:.2f} | "
              f"{down:.2f} | {down / t_raw:.2f}x |")
    print(f"\npages sent: 1st {first['pages_sent']} of {first['pages_total']}, "
          f"2nd {second['pages_sent']} of {second['pages_total']}; CRIU frozen: "
          f"{first['frozen_s']:.2f} s / {second['frozen_s']:.2f} s")
    for name in ("a", "b"):  # where each migration's downtime went (the source's log)
        for line in (work / name / "ckptd.log").read_text().splitlines():
            if '"ckptd.core.migrate"' in line and "migrated" in line:
                print(f"{name}: {json.loads(line)['msg']}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
