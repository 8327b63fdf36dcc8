"""What the benchmark scripts share: running a timed command, process and size helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CRIU = os.environ.get("CKPTD_CRIU", "/usr/local/sbin/criu")


def command_of(name: str, venv_bin: Path) -> list[str]:
    """How to run ``ckptd`` or ``ckptctl``: the venv's console script where it exists, else
    ``python -m`` of its module with this Python (a machine with ckptd on PYTHONPATH only,
    e.g. the GPU machine of scripts/device-check.sh). ``CKPTD_CRIU`` also goes to the daemon
    as ``--criu``."""
    script = venv_bin / name
    if script.exists():
        return [str(script)]
    module = {"ckptd": "ckptd.daemon.main", "ckptctl": "ckptd.transport.cli.main"}[name]
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]
CRIU_FLAGS = ["--shell-job", "--file-locks", "-v4"]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run ``cmd``; (wall seconds, stdout). Exits the benchmark, with stderr, if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}")
    return dt, proc.stdout


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``/proc/PID`` is gone (a zombie still holds its pid), at most ``timeout``."""
    end = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
        time.sleep(0.02)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_gone(pid)
