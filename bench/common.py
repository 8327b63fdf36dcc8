"""What the benchmarks share: raw CRIU, the workloads, timed commands, processes, daemons.

Invariants: a workload's pid is the one of the process this module started (the launcher's
``$!`` of an ``exec``, so the workload itself), never found by name (``pgrep`` could find
another benchmark's); ``CKPTD_CRIU`` names the CRIU of raw runs and of the daemons; ckptd and
ckptctl run from this Python's venv, or as ``python -c`` of their module where the venv has no
console scripts (a machine with ckptd on PYTHONPATH only, scripts/device-check.sh).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "native" / "workloads" / "bin"
VENV = Path(sys.executable).parent
CRIU = os.environ.get("CKPTD_CRIU", "/usr/local/sbin/criu")
CRIU_FLAGS = ["--shell-job", "--file-locks", "-v4"]


def command_of(name: str, venv_bin: Path = VENV) -> list[str]:
    """How to run ``ckptd`` or ``ckptctl``: the venv's console script where it exists, else
    ``python -m`` of its module with this Python (a machine with ckptd on PYTHONPATH only,
    e.g. the GPU machine of scripts/device-check.sh). ``CKPTD_CRIU`` also goes to the daemon
    as ``--criu``."""
    script = venv_bin / name
    if script.exists():
        return [str(script)]
    module = {"ckptd": "ckptd.daemon.main", "ckptctl": "ckptd.transport.cli.main"}[name]
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]


def need_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit("run as root (the daemon and CRIU need it)")


def build_workloads() -> None:
    """native/workloads/bin (counter, bigmem), built if stale."""
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "workloads")], check=True)


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


def status_mib(pid: int, field: str) -> float:
    """A size field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in MiB; 0 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ---- workloads ------------------------------------------------------------------------------


def _launch(argv: str, out: Path | None) -> int:
    """``argv`` (a shell word list) started in a session of its own, as a scheduler's
    launcher would; its pid (``$!`` of an ``exec``: the workload itself)."""
    sink = str(out) if out is not None else "/dev/null"
    launched = subprocess.run(
        ["setsid", "sh", "-c", f"exec {argv} > {sink} 2>&1 < /dev/null & echo $!"],
        check=True, capture_output=True, text=True,
    )
    return int(launched.stdout.split()[0])


def start_counter(out: Path, *, mib: int = 0, steps: int = 0, interval_ms: int = 200,
                  timeout: float = 120.0) -> int:
    """``counter`` (``--mem-mib MIB`` of random pages, one rewritten per step); its pid once
    its first step is written to ``out`` (the memory is filled then)."""
    out.write_text("")
    memory = f" --mem-mib {mib}" if mib else ""
    pid = _launch(f"{BIN}/counter --steps {steps} --interval-ms {interval_ms}{memory}", out)
    deadline = time.monotonic() + timeout
    while not out.read_text().startswith("step"):
        if time.monotonic() > deadline:
            kill(pid)
            raise SystemExit(f"counter did not start (see {out})")
        time.sleep(0.02)
    return pid


def start_bigmem(ready: Path, *, mib: int, out: Path | None = None, interval_ms: int = 200,
                 extra: str = "", timeout: float = 300.0) -> int:
    """``bigmem --mib MIB`` (mixed pages; ``extra``: ``--random``, ``--rewrite-pct P``); its
    pid once it has written ``ready``. ``out`` None: its output goes to /dev/null (a growing
    file could not be restored from an older raw dump)."""
    ready.unlink(missing_ok=True)
    pid = _launch(f"{BIN}/bigmem --mib {mib} --steps 0 --interval-ms {interval_ms} "
                  f"--ready-file {ready} {extra}".rstrip(), out)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if time.monotonic() > deadline:
            kill(pid)
            raise SystemExit("bigmem did not get ready")
        time.sleep(0.05)
    return pid


# ---- raw CRIU ---------------------------------------------------------------------------------


def criu_version(criu: str = CRIU) -> str:
    out = subprocess.run([criu, "--version"], capture_output=True, text=True, check=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Version:")), criu)


class RawCriu:
    """CRIU run by hand, the baseline every benchmark compares with: ``criu dump -t PID -D
    DIR`` and ``criu restore -D DIR -d``, timed from the command's start to its exit."""

    def __init__(self, criu: str = CRIU, flags: list[str] | None = None) -> None:
        self.criu = criu
        self.flags = CRIU_FLAGS if flags is None else flags

    def dump(self, pid: int, images: Path, *, leave_running: bool = False) -> float:
        """Seconds of a dump of ``pid`` into ``images`` (emptied first)."""
        shutil.rmtree(images, ignore_errors=True)
        images.mkdir(parents=True)
        extra = ["--leave-running"] if leave_running else []
        seconds, _ = timed([self.criu, "dump", "-t", str(pid), "-D", str(images),
                            "-o", "dump.log", *extra, *self.flags])
        return seconds

    def restore(self, images: Path) -> float:
        """Seconds until ``criu restore -d`` returns (the tree runs)."""
        seconds, _ = timed([self.criu, "restore", "-D", str(images), "-d",
                            "-o", "restore.log", *self.flags])
        return seconds

    @staticmethod
    def sync(images: Path) -> float:
        """Seconds of ``sync -f DIR`` (ckptd makes a checkpoint durable; CRIU does not)."""
        seconds, _ = timed(["sync", "-f", str(images)])
        return seconds


# ---- daemons ----------------------------------------------------------------------------------


class Daemon:
    """A ckptd (of ``tree``'s source: PYTHONPATH) with a store and state of its own under
    ``root``; stopped with SIGTERM by ``stop`` or on leaving a ``with`` block."""

    def __init__(self, root: Path, *, tree: Path = ROOT, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, log_level: str = "WARNING") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.sock = root / "ckptd.sock"
        self.env = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
        given = os.environ.get("CKPTD_CRIU") and "--criu" not in args
        criu = ["--criu", CRIU] if given else []
        self.log_path = root / "ckptd.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [*command_of("ckptd"), "--socket", str(self.sock), "--store",
                 str(root / "store"), "--state-dir", str(root / "state"), "--log-level",
                 log_level, *criu, *args],
                stderr=log, stdout=log, stdin=subprocess.DEVNULL, env=self.env,
            )
        while not self.sock.exists():
            if self.proc.poll() is not None:
                raise SystemExit(f"ckptd exited: see {self.log_path}")
            time.sleep(0.05)
        self.ctl = [*command_of("ckptctl"), "--socket", str(self.sock), "--json"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
