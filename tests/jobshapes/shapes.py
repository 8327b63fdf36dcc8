"""Helpers of the job-shape tier: the workloads' command lines, their uninterrupted runs (the
references), what a run leaves behind — its stdout, ``train.log`` and ``state.bin``, and
``metrics.csv`` for the ``metrics-csv`` kind — and the comparison of two runs bit for bit.

The workloads (``workloads/``) are plain scripts run by the checkout's .venv Python; see their
docstrings for what they print and write. A run's pace (seconds slept per step) changes when
its lines come, never what they are, so references are made with pace 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.integration.support import VENV_BIN, VENV_PYTHON, Procs, descendants, is_alive

WORKLOADS = Path(__file__).resolve().parent / "workloads"
DDP = WORKLOADS / "ddp_train.py"
DATALOADER = WORKLOADS / "dataloader_train.py"
SHARED_SPAWN = WORKLOADS / "shared_spawn.py"
SPAWN_QUEUE = WORKLOADS / "spawn_queue.py"
TORCHRUN = VENV_BIN / "torchrun"
LOG_NAME = "train.log"
STATE_NAME = "state.bin"
JOB_FILES = (LOG_NAME, STATE_NAME)
METRICS_NAME = "metrics.csv"
"""What ``--metrics-csv`` adds: a file opened, appended to and closed each step."""

PACE = 0.2
"""Seconds each workload sleeps per step in the tests: a checkpoint lands mid-run."""

Command = Callable[..., list[str]]


def dataloader_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """The single-process loop with a DataLoader of 2 worker processes."""
    return [str(VENV_PYTHON), str(DATALOADER), "--out-dir", str(out_dir),
            "--steps", str(steps), "--pace", str(pace)]


def metrics_csv_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """The DataLoader loop also logging each step to ``metrics.csv`` with the ``csv``
    module, opened for appending and closed again each step (MLflow's file store, a per-step
    CSV logger): no descriptor of it is held between steps."""
    return [*dataloader_cmd(out_dir, steps, pace), "--metrics-csv"]


BIG_BATCH_FLOATS = 98304
"""Extra floats per item of ``big_batches_cmd``: batches of 16 items are 6.3 MB."""


def big_batches_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """The DataLoader loop (2 forked workers) with 6 MB batches: torch hands each over in an
    unlinked /dev/shm file, which CRIU dumps as a ghost file (issue 24)."""
    return [*dataloader_cmd(out_dir, steps, pace), "--extra-floats", str(BIG_BATCH_FLOATS)]


def shared_spawn_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """An 8 MiB tensor in shared memory (an unlinked /dev/shm file) shared with a process
    started by torch.multiprocessing's spawn (issue 24)."""
    return [str(VENV_PYTHON), str(SHARED_SPAWN), "--out-dir", str(out_dir),
            "--steps", str(steps), "--pace", str(pace)]


def spawn_queue_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """A loop fed by a multiprocessing spawn-context worker through Queues: named POSIX
    semaphores (/dev/shm/sem.mp-*) mapped through an unlinked name (issue 34)."""
    return [str(VENV_PYTHON), str(SPAWN_QUEUE), "--out-dir", str(out_dir),
            "--steps", str(steps), "--pace", str(pace)]


def torchrun_cmd(out_dir: Path, steps: int, pace: float = PACE) -> list[str]:
    """DDP, 2 ranks on this node, launched by torchrun (its agent hosts the store, on a free
    port: ``--standalone``)."""
    return [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(DDP),
            "--out-dir", str(out_dir), "--steps", str(steps), "--pace", str(pace)]


def rank_cmd(out_dir: Path, steps: int, rank: int, master: str, port: int, ifname: str,
             pace: float = PACE) -> list[str]:
    """One DDP rank of 2 started by hand (``init_method=env://``); rank 0 hosts the store.
    ``USE_LIBUV=0``: its TCPStore without libuv, so without an io_uring (CRIU refuses those).
    ``GLOO_SOCKET_IFNAME``: the interface gloo's mesh uses (by default gloo advertises the
    address the host name resolves to, 127.0.0.1 here, unreachable from another node)."""
    env = [f"MASTER_ADDR={master}", f"MASTER_PORT={port}", f"RANK={rank}", "WORLD_SIZE=2",
           "USE_LIBUV=0", f"GLOO_SOCKET_IFNAME={ifname}"]
    return ["env", *env, str(VENV_PYTHON), str(DDP), "--out-dir", str(out_dir),
            "--steps", str(steps), "--pace", str(pace)]


@dataclass(frozen=True)
class Outcome:
    """What a run left: its stdout (rank 0's) and the files it wrote, byte for byte."""

    stdout: bytes
    files: dict[str, bytes]

    @classmethod
    def read(cls, stdout: Path, out_dir: Path, names: tuple[str, ...] = JOB_FILES) -> Outcome:
        return cls(stdout.read_bytes(), {n: (out_dir / n).read_bytes() for n in names})


def _first_difference(got: bytes, want: bytes) -> str:
    got_lines, want_lines = got.splitlines(), want.splitlines()
    for i, (a, b) in enumerate(zip(got_lines, want_lines, strict=False)):
        if a != b:
            return f"line {i + 1}: got {a!r}, expected {b!r}"
    if len(got_lines) != len(want_lines):
        n = min(len(got_lines), len(want_lines))
        return (f"{len(got_lines)} lines, expected {len(want_lines)}; from line {n + 1}: "
                f"got {got_lines[n:n + 2]!r}, expected {want_lines[n:n + 2]!r}")
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
             min(len(got), len(want)))
    return f"{len(got)} bytes, expected {len(want)}; first difference at byte {i}"


def assert_same_bytes(got: bytes, want: bytes, what: str) -> None:
    assert got == want, f"{what} differs from the uninterrupted run's: " + \
        _first_difference(got, want)


def assert_same_outcome(got: Outcome, want: Outcome, what: str) -> None:
    """Bit for bit: stdout and every file (the reference's files: all of them read)."""
    assert_same_bytes(got.stdout, want.stdout, f"{what}: stdout")
    assert set(got.files) == set(want.files), f"{what}: files {sorted(got.files)} read, " \
        f"the reference has {sorted(want.files)}"
    for name in want.files:
        assert_same_bytes(got.files[name], want.files[name], f"{what}: {name}")


def assert_kept_aside(path: Path, content: bytes) -> None:
    """What was on disk at ``path`` when the restore put the checkpoint's version back
    (``content``) is kept beside it — issue 11: "keep that version beside it (e.g.
    ``train.log.ckptd-<restore id>``)"; any sibling named ``<name>.*`` with those bytes does."""
    siblings = [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".")]
    assert any(p.read_bytes() == content for p in siblings), (
        f"the version of {path} found at restore ({len(content)} bytes) was not kept beside "
        f"it; siblings: {[p.name for p in siblings]}"
    )


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and every descendant at once (a node failing); returns their pids
    once all are gone."""
    victims = [pid, *descendants(pid)]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(is_alive(v) for v in victims):
        assert time.monotonic() < deadline, f"pids {victims} still alive 10s after SIGKILL"
        time.sleep(0.02)
    return victims


OUTSIDE_WRITER = """
import sys
log = open(sys.argv[1], "a", buffering=1)  # O_WRONLY|O_APPEND, as a logger opens its file
for line in sys.stdin:  # each line it is sent: appended (one write), then acknowledged
    log.write(line)
    print("wrote", flush=True)
"""


class OutsideWriter:
    """A process outside the job's tree (the test's child, not the job's) that holds
    ``path`` open for appending and writes each line it is given, on cue: a service sharing
    the job's log. ``lines`` is everything it wrote, in order."""

    def __init__(self, procs: Procs, path: Path) -> None:
        self.proc: subprocess.Popen[str] = procs.popen(
            [str(VENV_PYTHON), "-c", OUTSIDE_WRITER, str(path)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def append(self, line: str) -> None:
        """Write ``line`` (a newline is added) and return once it is in the file."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "wrote\n", f"outside writer {self.pid} died"
        self.lines.append(line)


def child_of(pid: int, timeout: float = 15.0) -> int:
    """The first child of ``pid`` (the job ``ckptctl run`` started), once it has one."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    deadline = time.monotonic() + timeout
    while not path.read_text().split():
        assert time.monotonic() < deadline, f"pid {pid} started no child in {timeout:g}s"
        time.sleep(0.02)
    return int(path.read_text().split()[0])


class References:
    """The uninterrupted run of each (workload, steps), made once (pace 0) when first asked;
    each under its own directory of ``root``."""

    BUILDERS: dict[str, Command] = {"ddp": torchrun_cmd, "dataloader": dataloader_cmd,
                                    "big-batches": big_batches_cmd,
                                    "shared-spawn": shared_spawn_cmd,
                                    "spawn-queue": spawn_queue_cmd,
                                    "metrics-csv": metrics_csv_cmd}
    FILES: dict[str, tuple[str, ...]] = {"metrics-csv": (*JOB_FILES, METRICS_NAME)}
    """The files a kind's run writes, when more than ``JOB_FILES``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[tuple[str, int], Outcome] = {}

    def get(self, kind: str, steps: int) -> Outcome:
        key = (kind, steps)
        if key not in self._made:
            self._made[key] = self.run(kind, steps)
        return self._made[key]

    def run(self, kind: str, steps: int) -> Outcome:
        """One more uninterrupted run, in a fresh directory."""
        n = sum(1 for _ in self.root.iterdir())
        run_dir = self.root / f"{kind}-{steps}-{n}"
        out_dir = run_dir / "out"
        run_dir.mkdir()
        stdout = run_dir / "stdout"
        with open(stdout, "wb") as out, open(run_dir / "stderr", "wb") as err:
            proc = subprocess.run(
                self.BUILDERS[kind](out_dir, steps, pace=0.0), stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, timeout=180, check=False, start_new_session=True,
            )
        assert proc.returncode == 0, (
            f"uninterrupted {kind} run exited {proc.returncode}: "
            f"{(run_dir / 'stderr').read_text(errors='replace')[-2000:]}"
        )
        return Outcome.read(stdout, out_dir, self.files(kind))

    @classmethod
    def files(cls, kind: str) -> tuple[str, ...]:
        """The files of ``out_dir`` a run of ``kind`` is compared by."""
        return cls.FILES.get(kind, JOB_FILES)
