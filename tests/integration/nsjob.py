"""A job that is the init of its own pid namespace (run under ``unshare --fork --pid``).

Usage: nsjob.py FIRST KIDS STEPS PERIOD_S OUTDIR

It forks KIDS children at the in-namespace pids FIRST, FIRST+1, ... (it writes
/proc/sys/kernel/ns_last_pid of its own namespace first) and then every process appends
STEPS lines of a deterministic sequence to OUTDIR/<name>.out, one every PERIOD_S seconds, so
an interrupted and restored run must leave exactly the files of an uninterrupted one. The
init waits for its children and writes ``done`` last."""

from __future__ import annotations

import os
import sys
import time


def work(outdir: str, name: str, steps: int, period: float) -> None:
    x = 1
    with open(os.path.join(outdir, f"{name}.out"), "a") as out:
        for i in range(steps):
            x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            out.write(f"{name} {i} {x}\n")
            out.flush()
            time.sleep(period)


def main() -> None:
    first, kids, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    period, outdir = float(sys.argv[4]), sys.argv[5]
    if os.getpid() != 1:
        sys.exit(f"nsjob.py must be pid 1 of its pid namespace, not {os.getpid()}")
    children = []
    for k in range(kids):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(first + k - 1))
        pid = os.fork()
        if pid == 0:
            work(outdir, f"child{k}", steps, period)
            os._exit(0)
        if pid != first + k:
            sys.exit(f"child {k} got pid {pid}, not {first + k}")
        children.append(pid)
    work(outdir, "init", steps, period)
    for pid in children:
        os.waitpid(pid, 0)
    with open(os.path.join(outdir, "done"), "w") as f:
        f.write("done\n")


if __name__ == "__main__":
    main()
