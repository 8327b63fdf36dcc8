"""Cost of ``ckptctl run``'s io_uring filter (a script you run, not a timed test).

A C loop makes N ``getpid`` calls (the syscall itself, no libc caching), N one-byte ``write``
calls to /dev/null and N/10 ``pread`` of 64 KiB from a file in the page cache, and prints ns
per call. In one run, rounds alternate, side by side:

  (a) no filter
  (b) the filter ``ckptctl run`` installs (``ckptd.transport.cli.no_io_uring``)
  (c) the same filter with a first instruction that loads a call argument, so that the
      kernel cannot cache "allowed" for any call and every call runs the filter: the cost
      the seccomp cache saves (a filter that looked at arguments would pay it)
  (d) a filter that allows everything (one instruction): the floor any seccomp filter
      costs (the system call entry takes the kernel's slower path)

plus the launch itself: ``Popen(["true"])`` with and without the filter's ``preexec_fn``
(which makes Python fork instead of vfork).

Usage: .venv/bin/python -m bench no-io-uring [--calls 2000000] [--rounds 7]
Prints a Markdown table of medians. Needs a C compiler (cc).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import Col, Report
from ckptd.transport.cli import no_io_uring

LOOP_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    long n = atol(argv[1]);
    int fd = open("/dev/null", O_WRONLY);
    int data = open(argv[2], O_RDONLY);
    static char buf[65536];
    char c = 'x';
    double t0 = now();
    for (long i = 0; i < n; i++) syscall(SYS_getpid);
    double t1 = now();
    for (long i = 0; i < n; i++) if (write(fd, &c, 1) != 1) return 1;
    double t2 = now();
    for (long i = 0; i < n / 10; i++) if (pread(data, buf, sizeof buf, 0) != sizeof buf) return 1;
    double t3 = now();
    printf("%.1f %.1f %.1f\n", (t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / (n / 10));
    return 0;
}
"""

ARG0_OFFSET = 16  # offsetof(struct seccomp_data, args[0])


def uncacheable() -> no_io_uring.Filter:
    """The same filter, but it reads an argument first: no call is cached as allowed."""
    return no_io_uring.Filter(((no_io_uring.BPF_LD_W_ABS, 0, 0, ARG0_OFFSET),
                               *no_io_uring.program()))


def loop(binary: Path, calls: int, preexec: Callable[[], None] | None
         ) -> tuple[float, float, float]:
    data = binary.with_name("data")
    out = subprocess.run([str(binary), str(calls), str(data)], preexec_fn=preexec,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


def launch_ms(preexec: Callable[[], None] | None, n: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.Popen(["true"], preexec_fn=preexec).wait()  # noqa: PLW1509 (no threads)
    return (time.perf_counter() - t0) / n * 1e3


def configure(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=7)


def run(args: argparse.Namespace, report: Report) -> int:
    if not no_io_uring.supported():
        raise SystemExit("the filter is for x86_64 and aarch64 only")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "loop"
        (Path(tmp) / "loop.c").write_text(LOOP_C)
        (Path(tmp) / "data").write_bytes(os.urandom(65536))
        subprocess.run(["cc", "-O2", "-o", str(binary), str(Path(tmp) / "loop.c")], check=True)
        kinds: dict[str, Callable[[], None] | None] = {
            "(a) no filter": None,
            "(b) ckptctl run's filter": no_io_uring.Filter().install,
            "(c) same filter, not cacheable": uncacheable().install,
            "(d) allow-everything filter": no_io_uring.Filter(
                ((no_io_uring.BPF_RET_K, 0, 0, no_io_uring.SECCOMP_RET_ALLOW),)).install,
        }
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for kind, preexec in kinds.items():
                results[kind].append(loop(binary, args.calls, preexec))
        launches = {k: launch_ms(kinds[k]) for k in list(kinds)[:2]}
    base = [statistics.median(r[i] for r in results["(a) no filter"]) for i in (0, 1, 2)]
    report.units = {"time": "ns per call", "launch_ms": "ms"}
    table = report.table("calls", [
        Col("filter", ""), Col("getpid", fmt="{:.1f}"),
        Col("write", "write(/dev/null, 1 B)", fmt="{:.1f}"),
        Col("pread", "pread(64 KiB, page cache)", fmt="{:.1f}"),
        Col("getpid_more", "getpid more than (a)", "{:+.1f}"),
        Col("write_more", "write more than (a)", "{:+.1f}"),
        Col("pread_more", "pread more than (a)", "{:+.1f}"),
    ], note=f"{args.calls} getpid and write calls, {args.calls // 10} pread, {args.rounds} "
            "rounds, medians (ns per call)")
    for kind, rows in results.items():
        ns = [statistics.median(r[i] for r in rows) for i in (0, 1, 2)]
        table.add(kind, *ns, *(ns[i] - base[i] for i in (0, 1, 2)))
    report.show(table)
    launch = report.table("launch", [Col("launch"),
                                     Col("launch_ms", "Popen(['true']).wait() ms", "{:.2f}")])
    for kind, ms in launches.items():
        launch.add(kind, ms)
    report.show(launch)
    return 0
