"""Migration of a 1 GiB job between two daemons, against the raw CRIU baseline, in one run.

Two ckptd daemons on loopback (each its own store, mutual TLS from scripts/make-peer-certs.sh)
move `counter --mem-mib N` (N MiB of incompressible memory, one page rewritten per step)
A -> B, let it run a few seconds, then B -> A. Reported per migration: bytes sent, wall time
of `ckptctl migrate`, and the job's downtime (from its freeze to running on the target), then
where the downtime went, per step (from the source daemon's log).

Baseline, the same job by hand: `criu dump` -> `tar | zstd -1 -T0 | zstd -d | tar -x` into a
second directory (the pipe stands for the network) -> `criu restore`: every migration moves
everything.

Usage (root): .venv/bin/python -m bench migrate [--mib 1024] [--pause 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import (
    ROOT,
    Daemon,
    RawCriu,
    build_workloads,
    kill,
    need_root,
    start_counter,
    timed,
    wait_gone,
)
from bench.report import Col, Report

RAW = RawCriu(flags=["--shell-job"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raw_move(pid: int, work: Path) -> tuple[float, int]:
    """criu dump, compressed copy through a pipe, criu restore: (seconds, bytes moved)."""
    src, dst = work / "raw-src", work / "raw-dst"
    for d in (src, dst):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    start = time.monotonic()
    RAW.dump(pid, src)
    wait_gone(pid)
    size_file = work / "raw-bytes"
    subprocess.run(
        ["sh", "-c", f"tar -C {src} -cf - . | zstd -q -1 -T0 | tee >(wc -c > {size_file}) "
                     f"| zstd -q -d | tar -C {dst} -xf -"],
        check=True, executable="/bin/bash",
    )
    RAW.restore(dst)
    elapsed = time.monotonic() - start
    time.sleep(0.2)
    return elapsed, int(size_file.read_text().split()[0] or 0)


def daemon(work: Path, name: str, pki: Path) -> tuple[Daemon, str]:
    """A daemon of node ``name`` listening for peers on loopback (mutual TLS): it and its
    peer address."""
    address = f"127.0.0.1:{free_port()}"
    conf = work / f"{name}.toml"
    conf.write_text(
        f'node = "{name}"\npeer_listen = "{address}"\ntls_cert = "{pki}/{name}.pem"\n'
        f'tls_key = "{pki}/{name}.key"\ntls_ca = "{pki}/ca.pem"\n'
    )
    return Daemon(work / name, args=("--config", str(conf)), log_level="INFO"), address


def migrate(source: Daemon, pid: int, to: str) -> tuple[float, dict[str, object]]:
    t, out = timed([*source.ctl, "migrate", str(pid), "--to", to])
    return t, json.loads(out)


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--pause", type=float, default=5.0, help="seconds on B before moving back")


def run(args: argparse.Namespace, report: Report) -> int:
    need_root()
    build_workloads()
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-migrate-", dir="/var/tmp"))
    pki = work / "pki"
    subprocess.run(["bash", str(ROOT / "scripts" / "make-peer-certs.sh"), str(pki),
                    "a=127.0.0.1", "b=127.0.0.1"], check=True, capture_output=True)
    daemons: list[Daemon] = []
    try:
        # baseline: two full moves (raw CRIU has nothing incremental)
        pid = start_counter(work / "raw.out", mib=args.mib)
        raw = [raw_move(pid, work)]
        time.sleep(args.pause)
        raw.append(raw_move(pid, work))
        kill(pid)
        wait_gone(pid)

        a, addr_a = daemon(work, "a", pki)
        daemons.append(a)
        b, addr_b = daemon(work, "b", pki)
        daemons.append(b)
        pid = start_counter(work / "ckptd.out", mib=args.mib)
        t1, first = migrate(a, pid, addr_b)
        time.sleep(args.pause)
        t2, second = migrate(b, pid, addr_a)
        kill(pid)
    finally:
        for d in daemons:
            d.stop()
    report.units = {"bytes": "bytes", "time": "s"}
    table = report.table("migrate", [
        Col("migration"), Col("path"), Col("bytes_sent", "bytes sent", "{:,}"),
        Col("bytes_vs_raw", "vs raw", "{:.3f}x"), Col("wall", "wall (s)", "{:.2f}"),
        Col("downtime", "downtime (s)", "{:.2f}"), Col("downtime_vs_raw", "vs raw", "{:.2f}x"),
    ], note=f"{args.mib} MiB job (`counter --mem-mib {args.mib}`: incompressible memory, one "
            f"page rewritten per 200 ms step), {args.pause:g} s on B between the moves; "
            f"loopback, kernel {os.uname().release}, {os.cpu_count()} CPUs")
    for label, (t, res), (t_raw, b_raw) in (
        ("1st (A->B)", (t1, first), raw[0]), ("2nd (B->A)", (t2, second), raw[1])
    ):
        sent = int(str(res["bytes_sent"]))
        down = float(str(res["downtime_s"]))
        table.add(label, "raw criu + zstd -1 -T0", b_raw, 1.0, t_raw, t_raw, 1.0)
        table.add(label, "ckptctl migrate", sent, sent / b_raw, t, down, down / t_raw)
    report.show(table)
    report.say(f"\npages sent: 1st {first['pages_sent']} of {first['pages_total']}, "
               f"2nd {second['pages_sent']} of {second['pages_total']}; CRIU frozen: "
               f"{first['frozen_s']:.2f} s / {second['frozen_s']:.2f} s")
    for d in daemons:  # where each migration's downtime went (the source's log)
        for line in d.log_path.read_text().splitlines():
            if '"ckptd.core.migrate"' in line and "migrated" in line:
                report.say(f"{d.root.name}: {json.loads(line)['msg']}")
    shutil.rmtree(work, ignore_errors=True)
    return 0
