"""Run as pid 1 of a new pid namespace (``unshare --pid --fork --mount-proc``) by
test_session_zero.py; prints one JSON object with what happened.

This process inherits the session of whoever started unshare, whose leader is outside the new
namespace: here getsid() is 0, as for everything under an init that never called setsid (the
CI machines' init, some container inits). It starts a ckptd in the namespace, then two
counters: one left in session 0, one in a session of its own; and tries to checkpoint both.
Usage: pidns_scenario.py ROOT CKPTD CKPTCTL COUNTER [CKPTD-FLAG ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def session_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[3])


def state_of(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()[0]


def main() -> None:
    root, ckptd, ckptctl, counter = (Path(a) for a in sys.argv[1:5])
    sock = root / "run" / "ckptd.sock"
    with open(root / "ckptd.log", "wb") as log:
        daemon = subprocess.Popen(
            [
                str(ckptd),
                "--socket",
                str(sock),
                "--store",
                str(root / "store"),
                "--state-dir",
                str(root / "state"),
                *sys.argv[5:],
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd="/",
            start_new_session=True,
        )
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline and daemon.poll() is None:
        time.sleep(0.05)

    def ctl(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ckptctl), "--socket", str(sock), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    job = [str(counter), "--steps", "100000", "--interval-ms", "20"]
    in_zero = subprocess.Popen(
        job, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    own = subprocess.Popen(
        job,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(0.3)
    refused = ctl("dump", in_zero.pid)
    dumped = ctl("--json", "dump", "--leave-running", own.pid)
    time.sleep(0.2)
    report = {
        "own_session": os.getsid(0),
        "zero": {
            "session": session_of(in_zero.pid),
            "rc": refused.returncode,
            "stdout": refused.stdout,
            "stderr": refused.stderr,
            "state": state_of(in_zero.pid),
        },
        "own": {
            "session": session_of(own.pid),
            "rc": dumped.returncode,
            "stdout": dumped.stdout,
            "stderr": dumped.stderr,
            "state": state_of(own.pid),
        },
        "daemon_alive": daemon.poll() is None,
    }
    print(json.dumps(report))
    # pid 1 of the namespace: when it exits, the kernel kills everything left in it.


if __name__ == "__main__":
    main()
