#!/usr/bin/env python3
"""Which processes of a real ``torchrun --nproc_per_node=2`` job (gloo, PyTorch's defaults)
hold an io_uring instance, launched without and with ``ckptctl run``'s filter (a manual
check, not a test: it needs PyTorch in this interpreter).

It lists every process of the tree (the torchrun agent, the two ranks), with ``io_uring`` when
/proc/PID/fd or /proc/PID/maps shows ``anon_inode:[io_uring]``; then it times the ranks'
all-reduce loop over several launches of each kind, alternated.

Usage: .venv/bin/python scripts/check_torchrun_io_uring.py [--steps 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptd.transport.cli import no_io_uring  # noqa: E402

TRAIN = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1 << 16)
t0 = time.perf_counter()
for _ in range(int(sys.argv[1])):
    dist.all_reduce(x)
took = time.perf_counter() - t0
os.write(1, f"rank {dist.get_rank()} ready {took:.3f}\\n".encode())  # one write: ranks share it
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""
IO_URING = "anon_inode:[io_uring]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree(pid: int) -> list[int]:
    out, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            queue.extend(int(c) for c in (task / "children").read_text().split())
    return out


def holds_io_uring(pid: int) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    links = set()
    for fd in fds.iterdir():
        try:
            links.add(os.readlink(fd))
        except OSError:
            continue
    return IO_URING in links or IO_URING in Path(f"/proc/{pid}/maps").read_text()


def describe(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = " ".join(c.decode() for c in cmdline if c)
    if "torch.distributed.run" in text or "torchrun" in text:
        return "torchrun agent"
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), "?")
    return f"rank {rank}"


def check(label: str, preexec: Callable[[], None] | None, steps: int, show: bool) -> float:
    """Launch the job, list its processes (``show``); the slower rank's all-reduce time."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        release = Path(tmp) / "release"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(script), str(steps), str(release)]
        job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                               preexec_fn=preexec)  # noqa: PLW1509 (no threads here)
        assert job.stdout is not None
        try:
            ready = []
            while len(ready) < 2:
                line = job.stdout.readline()
                if not line:
                    raise SystemExit(f"{label}: the job ended before its ranks were ready")
                if line.startswith("rank "):
                    ready.append(line.split())
                else:
                    print(f"({label}: the job says {line.strip()!r})")
            took = max(float(r[3]) for r in ready)
            if show:
                print(f"\n{label}:\n\n| process | pid | Seccomp | io_uring |\n"
                      "|---|---|---|---|")
            for pid in tree(job.pid) if show else ():
                mode = next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text()
                            .splitlines() if ln.startswith("Seccomp:"))
                print(f"| {describe(pid)} | {pid} | {mode} | "
                      f"{'yes' if holds_io_uring(pid) else 'no'} |")
            release.touch()
            job.wait(timeout=60)
            return took
        finally:
            if job.poll() is None:  # the ranks run in sessions of their own
                for pid in reversed(tree(job.pid)):
                    os.kill(pid, signal.SIGKILL)
                job.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch  # noqa: F401 - fail early, with the reason, without PyTorch

    started = time.monotonic()
    kinds: dict[str, Callable[[], None] | None] = {
        "without the filter": None, "with ckptctl run's filter": no_io_uring.preexec()}
    took: dict[str, list[float]] = {k: [] for k in kinds}
    for n in range(args.rounds):  # alternate, and swap the order every round
        for kind in list(kinds)[:: 1 if n % 2 == 0 else -1]:
            took[kind].append(check(kind, kinds[kind], args.steps, show=n == 0))
    print(f"\n{args.steps} all-reduce of 64 Ki floats per launch, {args.rounds} launches each "
          "(the slower rank's time):\n\n| | median s | min s | max s |\n|---|---|---|---|")
    for kind, times in took.items():
        print(f"| {kind} | {statistics.median(times):.3f} | {min(times):.3f} | "
              f"{max(times):.3f} |")
    print(f"\n({time.monotonic() - started:.1f}s; PyTorch {sys.modules['torch'].__version__})")


if __name__ == "__main__":
    main()
