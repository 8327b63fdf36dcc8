#!/usr/bin/env python3
"""The checks of ckptd on a GPU machine (issue 22): run by ``scripts/device-check.sh``.

``device_check.py OUTDIR [--dry-run] [--criu PATH] [--budget-s S] [--sizes-gib 1,8]``

Each check runs a job of ``native/gpu`` once uninterrupted (the reference, same seed) and
once through a checkpoint, and compares the output bit for bit: stop-mode dump and restore,
a leave-running dump then SIGKILL (a node failure) and restore, the raw CUDA ``fill``, a job
with DataLoader workers, a restore through the driver's remap path with the identity map,
the daemon SIGKILLed after the lock and after the device checkpoint (then restarted), and the
tests of ``tests/gpu``. Then the figures: phase times and GB/s per size against a plain copy
of the same bytes, and the new bytes of a second checkpoint of an inference-like job.

Every step has a time limit; a failed step is recorded and the run goes on; the report
(``report.md``, ``report.json``, every figure with its unit) is written into OUTDIR; the
daemons are stopped; a short table is printed last. Restored CUDA jobs are never SIGKILLed
(cuda-checkpoint issue 53): they finish by themselves, or are checkpointed (which ends them).

``--dry-run`` (no GPU): the same orchestration with the jobs on the CPU (``--device cpu``,
``native/workloads/bin/counter`` for ``fill``) and the daemon's GPU adapters replaced by a
``FakeGpu`` (``scripts/device_check_daemon.py``); what only a GPU can do is marked skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPU_DIR = REPO / "native" / "gpu"
WORKLOADS_BIN = REPO / "native" / "workloads" / "bin"
WRAPPER = REPO / "scripts" / "device_check_daemon.py"
GIB = 2**30
MIB = 2**20
TESTS_GPU_RESERVE_S = 90.0
"""Of the run's budget, kept for ``tests/gpu`` (run last)."""
DEFAULT_CRIU = (REPO / ".device" / "criu" / "criu", Path("/usr/local/sbin/criu"))


class StepTimeout(Exception):
    """A step ran past its limit (raised by SIGALRM in the main thread)."""


class Skipped(Exception):
    """A step that cannot run here (the reason is its message)."""


@dataclass
class Result:
    name: str
    what: str
    status: str = "not run"  # pass, FAIL, skipped, not run
    seconds: float = 0.0
    note: str = ""
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def figure(self, key: str, value: float | int | str, unit: str) -> None:
        self.figures[key] = {"value": value, "unit": unit}


# ---- processes --------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X")


def wait_until(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def lines_of(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def step_lines(path: Path) -> int:
    return sum(1 for ln in lines_of(path) if ln.startswith("step "))


def done(path: Path) -> bool:
    return any(ln.startswith("done ") for ln in lines_of(path))


def compare(got: list[str], want: list[str], what: str) -> None:
    if got == want:
        return
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            raise AssertionError(f"{what}: line {i + 1} is {g!r}, the reference has {w!r}")
    raise AssertionError(f"{what}: {len(got)} lines, the reference has {len(want)} "
                         f"(last: {got[-1:]!r} vs {want[-1:]!r})")


class Job:
    """A job of the checks: stdout and stderr into files (a restore reopens them), its own
    session, stdin /dev/null. ``restored``: the pid now belongs to a restored tree."""

    def __init__(self, ctx: Context, name: str, cmd: Sequence[str], env: dict[str, str]) -> None:
        self.ctx = ctx
        self.out = ctx.work / f"{name}.out"
        self.err = ctx.work / f"{name}.err"
        self.out.unlink(missing_ok=True)
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, env={**os.environ, **env}, cwd=ctx.work,
            )
        self.pid = self.proc.pid
        self.restored = False
        ctx.jobs.append(self)

    def wait_steps(self, n: int, timeout: float = 120.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None and not self.restored:
                raise AssertionError(f"job exited {self.proc.returncode} early: "
                                     f"{self.err.read_text(errors='replace')[-1500:]}")
            return step_lines(self.out) >= n
        wait_until(ready, timeout, f"{n} step lines of pid {self.pid}")

    def reap(self, timeout: float = 30.0) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_done(self, timeout: float) -> list[str]:
        wait_until(lambda: done(self.out), timeout, f"the done line of pid {self.pid}",
                   every=0.1)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not alive(self.pid), 30, f"pid {self.pid} to exit")
        self.proc.poll()
        return lines_of(self.out)


# ---- the daemon -------------------------------------------------------------------------------


class Daemon:
    """``scripts/device_check_daemon.py`` (the real daemon with the check's hooks)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.root = ctx.work / "ckptd"
        self.socket = self.root / "ckptd.sock"
        self.log_path = ctx.work / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "ckptd.toml").write_text(
            "gc_grace_s = 0\ngc_interval_s = 0\n"
            f'jobs_cgroup = "/ckptd-device-check-{os.getpid()}"\n'
        )

    def start(self, timeout: float = 60.0) -> None:
        env = {**os.environ, "CKPTD_CHECK_CONTROL": str(self.ctx.control)}
        if self.ctx.dry_run:
            env["CKPTD_CHECK_FAKE_GPU"] = "1"
        cmd = [
            sys.executable, str(WRAPPER), "--config", str(self.root / "ckptd.toml"),
            "--socket", str(self.socket), "--store", str(self.root / "store"),
            "--state-dir", str(self.root / "state"), "--criu", self.ctx.criu,
        ]
        mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         cwd="/", env=env, start_new_session=True)

        def serving() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"ckptd exited {self.proc.returncode} at start: "
                                     f"{self.log_tail(mark)}")
            with open(self.log_path, "rb") as log:
                log.seek(mark)
                return self.socket.is_socket() and b"serving on" in log.read()
        wait_until(serving, timeout, "ckptd to serve")

    def log_tail(self, mark: int = 0, n: int = 3000) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(mark)
            return log.read().decode(errors="replace")[-n:]

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def ctl_argv(self, *args: object) -> list[str]:
        return [sys.executable, "-m", "ckptd.transport.cli", "--socket", str(self.socket),
                "--json", *map(str, args)]

    def ctl(self, *args: object, timeout: float = 300.0) -> Any:
        proc = subprocess.run(self.ctl_argv(*args), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd="/", check=False)
        if proc.returncode != 0:
            raise AssertionError(f"ckptctl {' '.join(map(str, args))} exited {proc.returncode}:"
                                 f" {proc.stderr.strip()[-1500:]}")
        return json.loads(proc.stdout) if proc.stdout.strip() else {}


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Context:
    out: Path
    work: Path
    dry_run: bool
    criu: str
    deadline: float
    sizes_gib: list[int]
    infer_mib: int
    control: Path
    results: list[Result] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    daemon: Daemon | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    references: dict[str, list[str]] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # the jobs: on the GPU, or on the CPU in a dry run
    def env(self, device_bytes: int) -> dict[str, str]:
        return {"CKPTD_FAKE_CUDA": str(device_bytes)} if self.dry_run else {}

    def dev(self) -> list[str]:
        return ["--device", "cpu"] if self.dry_run else []

    def train_cmd(self, steps: int, interval_ms: int) -> list[str]:
        return [sys.executable, str(GPU_DIR / "train.py"), "--steps", str(steps),
                "--interval-ms", str(interval_ms), *self.dev()]

    def loader_cmd(self, steps: int, interval_ms: int) -> list[str]:
        return [sys.executable, str(GPU_DIR / "train_loader.py"), "--steps", str(steps),
                "--interval-ms", str(interval_ms), "--workers", "2", *self.dev()]

    def fill_cmd(self, steps: int, interval_ms: int, mib: int) -> list[str]:
        if self.dry_run:
            return [str(WORKLOADS_BIN / "counter"), "--steps", str(steps), "--interval-ms",
                    str(interval_ms), "--mem-mib", str(min(mib, 64))]
        return [str(GPU_DIR / "bin" / "fill"), "--steps", str(steps), "--interval-ms",
                str(interval_ms), "--mib", str(mib)]

    def infer_cmd(self, steps: int, interval_ms: int) -> list[str]:
        return [sys.executable, str(GPU_DIR / "infer.py"), "--steps", str(steps),
                "--interval-ms", str(interval_ms), "--mib", str(self.infer_mib), *self.dev()]

    def need_daemon(self) -> Daemon:
        if self.daemon is None or self.daemon.proc is None or self.daemon.proc.poll() is not None:
            raise AssertionError("ckptd is not running (see the daemon step)")
        return self.daemon

    def reference(self, key: str, cmd: list[str], env: dict[str, str],
                  timeout: float = 120.0) -> list[str]:
        """The uninterrupted run of ``cmd`` (interval 0), once per key."""
        if key not in self.references:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False,
                                  env={**os.environ, **env})
            if proc.returncode != 0:
                raise AssertionError(f"reference run of {key} exited {proc.returncode}: "
                                     f"{proc.stderr.strip()[-1500:]}")
            self.references[key] = proc.stdout.splitlines()
        return self.references[key]

    def end_job(self, job: Job) -> None:
        """Stop a job still running: a restored CUDA job is checkpointed (which ends it),
        never SIGKILLed (cuda-checkpoint issue 53); others are SIGKILLed."""
        if not alive(job.pid):
            job.proc.poll()
            return
        if job.restored and not self.dry_run and self.daemon is not None:
            with contextlib.suppress(Exception):
                self.daemon.ctl("dump", job.pid, timeout=180)
                return
            log(f"  could not checkpoint restored job {job.pid}: it is left running")
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
        job.reap(10)


def log(text: str) -> None:
    print(text, flush=True)


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise StepTimeout


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_step(ctx: Context, name: str, what: str, limit: float,
             body: Callable[[Context, Result], None], gpu_only: bool = False) -> Result:
    res = Result(name, what)
    ctx.results.append(res)
    if gpu_only and ctx.dry_run:
        res.status, res.note = "skipped", "skipped: dry run (needs a GPU)"
        log(f"== {name}: {res.note}")
        return res
    budget = min(limit, ctx.left())
    if budget < 5:
        res.status, res.note = "skipped", "skipped: the run's time budget is spent"
        log(f"== {name}: {res.note}")
        return res
    log(f"== {name} (limit {budget:.0f}s): {what}")
    started = time.monotonic()
    jobs_before = len(ctx.jobs)
    try:
        with time_limit(budget):
            body(ctx, res)
        res.status = "pass"
    except Skipped as exc:
        res.status, res.note = "skipped", f"skipped: {exc}"
    except StepTimeout:
        res.status, res.note = "FAIL", f"timed out after {budget:.0f}s"
    except Exception as exc:
        res.status = "FAIL"
        res.note = f"{type(exc).__name__}: {exc}"[:1500]
        traceback.print_exc(file=sys.stdout)
    finally:
        with time_limit(120), contextlib.suppress(Exception, StepTimeout):
            for job in ctx.jobs[jobs_before:]:
                ctx.end_job(job)
    res.seconds = round(time.monotonic() - started, 2)
    log(f"   {res.status} in {res.seconds:.1f}s {res.note}".rstrip())
    return res


# ---- the checks -------------------------------------------------------------------------------

TRAIN_STEPS, TRAIN_MS = 60, 50
DRY_STEPS = 30  # the CPU jobs of a dry run: shorter
DUMP_AFTER = 10


def job_and_reference(ctx: Context, key: str) -> tuple[Job, list[str]]:
    """Start the job ``key`` and get its reference (run before, uninterrupted)."""
    cmd: Callable[[int, int], list[str]]
    if key == "train":
        cmd, env = ctx.train_cmd, ctx.env(64 * MIB)
    elif key == "loader":
        cmd, env = ctx.loader_cmd, ctx.env(64 * MIB)
    else:
        def fill(steps: int, ms: int) -> list[str]:
            return ctx.fill_cmd(steps, ms, 256)
        cmd, env = fill, ctx.env(256 * MIB)
    steps = DRY_STEPS if ctx.dry_run else TRAIN_STEPS
    ref = ctx.reference(key, cmd(steps, 0), env)
    job = Job(ctx, key, cmd(steps, TRAIN_MS), env)
    return job, ref


def restore(ctx: Context, job: Job, ck_id: str, res: Result) -> None:
    answer = ctx.need_daemon().ctl("restore", ck_id, timeout=300)
    if int(answer["pid"]) != job.pid:
        raise AssertionError(f"restored as pid {answer['pid']}, not {job.pid}")
    job.restored = True
    res.figure("restore_total_s", round(float(answer.get("duration_s", 0.0)), 3), "s")


def record_gpu(res: Result, ck: dict[str, Any]) -> None:
    gpu = ck.get("gpu") or {}
    if not gpu:
        raise AssertionError(f"checkpoint {ck.get('id')} has no GPU facts: the daemon did "
                             "not see a CUDA process")
    for key in ("lock_s", "checkpoint_s", "restore_s", "unlock_s"):
        res.figure(key, round(float(gpu.get(key, 0.0)), 4), "s")
    res.figure("criu_frozen_s", round(float(ck.get("frozen_s", 0.0)), 4), "s")
    res.figure("dump_total_s", round(float(ck.get("duration_s", 0.0)), 3), "s")
    res.figure("bytes_stored", int(ck.get("bytes", 0)), "B")


def stop_mode(key: str) -> Callable[[Context, Result], None]:
    def body(ctx: Context, res: Result) -> None:
        job, ref = job_and_reference(ctx, key)
        job.wait_steps(DUMP_AFTER)
        ck = ctx.need_daemon().ctl("dump", job.pid, timeout=300)
        record_gpu(res, ck)
        if job.reap(30) != -signal.SIGKILL:
            raise AssertionError("the stop-mode dump did not end the job")
        restore(ctx, job, ck["id"], res)
        compare(job.wait_done(180), ref, f"{key} after stop-mode dump and restore")
        res.note = f"{len(ref)} lines equal the uninterrupted run's"
    return body


def leave_running_sigkill(ctx: Context, res: Result) -> None:
    job, ref = job_and_reference(ctx, "train")
    job.wait_steps(DUMP_AFTER)
    ck = ctx.need_daemon().ctl("dump", job.pid, "--leave-running", timeout=300)
    record_gpu(res, ck)
    job.wait_steps(step_lines(job.out) + 3)  # runs on, on its GPU
    if done(job.out):
        raise AssertionError("the job finished before the SIGKILL: lengthen it")
    os.kill(job.pid, signal.SIGKILL)  # a node failure (the original, never restored)
    job.reap(30)
    restore(ctx, job, ck["id"], res)
    compare(job.wait_done(180), ref, "train after leave-running dump, SIGKILL and restore")
    res.note = f"{len(ref)} lines equal the uninterrupted run's"


def identity_remap(ctx: Context, res: Result) -> None:
    flag = ctx.control / "identity-remap"
    used = ctx.control / "identity-remap-used"
    used.unlink(missing_ok=True)
    flag.touch()
    try:
        stop_mode("fill")(ctx, res)
    finally:
        flag.unlink(missing_ok=True)
    if not used.exists():
        raise AssertionError("the restore did not go through the remap path")
    pid, pairs = used.read_text().split()[:2]
    res.note += f"; CUcheckpointRestoreArgs with {pairs} identity pair(s) for pid {pid}"


def memory_cgroup_refusal(ctx: Context, res: Result) -> None:
    """Issue 23, point 3: the driver copies device memory into the job's own memory, charged
    to its memory cgroup. A job whose cgroup cannot take its device memory on top of what it
    holds is refused before anything is locked or frozen, with needed / free / limit in one
    line, and runs on; then, with room, the same job is checkpointed."""
    from ckptd.adapters.procfs.cgroups import cgroup2_root_with

    root = cgroup2_root_with("memory", Path("/proc/self/mountinfo").read_text())
    if root is None:
        raise Skipped("no memory controller in the cgroup2 hierarchy")
    if "memory" not in (root / "cgroup.subtree_control").read_text().split():
        (root / "cgroup.subtree_control").write_text("+memory")
    cg = root / f"ckptd-device-check-{os.getpid()}"
    cg.mkdir(exist_ok=True)
    job = None
    try:
        mib = 256
        cmd = ctx.fill_cmd(DRY_STEPS if ctx.dry_run else TRAIN_STEPS, TRAIN_MS, mib)
        job = Job(ctx, "fill_cg", cmd, ctx.env(mib * MIB))
        (cg / "cgroup.procs").write_text(str(job.pid))
        job.wait_steps(3)
        current = int((cg / "memory.current").read_text())
        (cg / "memory.max").write_text(str(current + 64 * MIB))  # device memory: 256 MiB
        before = step_lines(job.out)
        daemon = ctx.need_daemon()
        proc = subprocess.run(daemon.ctl_argv("dump", job.pid, "--leave-running"),
                              capture_output=True, text=True, timeout=120, check=False)
        said = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0:
            raise AssertionError(f"the dump was not refused: {said[-300:]}")
        if "memory" not in said or "cgroup" not in said:
            raise AssertionError(f"refused, but not for the cgroup: {said[-400:]}")
        job.wait_steps(before + 2, timeout=30)  # never frozen: it runs on
        if ctx.dry_run is False and cuda_state(ctx, job.pid) != "RUNNING":
            raise AssertionError("the refused job is not RUNNING in CUDA")
        res.note = f"refused, ran on: {said.splitlines()[-1][:160]}"
        (cg / "memory.max").write_text("max")
        ck = daemon.ctl("dump", job.pid, "--leave-running", timeout=300)
        record_gpu(res, ck)
        res.note += "; with room: checkpointed"
    finally:
        if job is not None:
            ctx.end_job(job)
        with contextlib.suppress(OSError):
            (cg / "memory.max").write_text("max")
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def cuda_state(ctx: Context, pid: int) -> str:
    """The driver's state of ``pid`` (RUNNING...), or 'n/a (dry run)'."""
    if ctx.dry_run:
        return "n/a (dry run)"
    from ckptd.adapters.cuda import CudaDriverCheckpointer

    gpu = CudaDriverCheckpointer(call_timeout_s=60)
    try:
        return str(gpu.state(pid).name)
    finally:
        gpu.close()


def daemon_killed_after(step: str) -> Callable[[Context, Result], None]:
    def body(ctx: Context, res: Result) -> None:
        daemon = ctx.need_daemon()
        job, ref = job_and_reference(ctx, "train")
        job.wait_steps(DUMP_AFTER)
        flag, marker = ctx.control / f"pause-after-{step}", ctx.control / f"paused-{step}"
        marker.unlink(missing_ok=True)
        flag.touch()
        dump = subprocess.Popen(daemon.ctl_argv("dump", job.pid), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            wait_until(marker.exists, 120, f"the daemon to pause after the {step}")
            flag.unlink()
            t0 = time.monotonic()
            daemon.kill9()
            dump.wait(timeout=30)
            daemon.start()  # recovery: the journal names the CUDA pids
        finally:
            flag.unlink(missing_ok=True)
            if dump.poll() is None:
                dump.kill()
                dump.wait()
        job.restored = True  # its CUDA went through the driver: never SIGKILL it (issue 53)
        wait_until(lambda: alive(job.pid), 5, "the job to be alive")
        state = cuda_state(ctx, job.pid)
        if not ctx.dry_run:
            wait_until(lambda: cuda_state(ctx, job.pid) == "RUNNING", 60,
                       f"pid {job.pid} to be RUNNING in CUDA")
            state = "RUNNING"
        res.figure("recovered_after_s", round(time.monotonic() - t0, 2), "s")
        compare(job.wait_done(180), ref, f"train after the daemon was killed after the {step}")
        res.note = f"CUDA state after restart {state}; {len(ref)} lines equal the reference"
    return body


def venv_shims() -> None:
    """``tests/integration/support`` runs ``.venv/bin/{ckptd,ckptctl,python}``: on a machine
    without the venv (the GPU machine), shims running this Python on the tree."""
    bindir = REPO / ".venv" / "bin"
    if (bindir / "ckptd").exists():
        return
    bindir.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PYTHONPATH", "")
    for name, target in (("ckptd", "-m ckptd.daemon.main"),
                         ("ckptctl", "-m ckptd.transport.cli"), ("python", "")):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}:{path}" exec {sys.executable} '
                        f'{target} "$@"\n')
        shim.chmod(0o755)


def tests_gpu(ctx: Context, res: Result) -> None:
    if not ctx.dry_run:
        venv_shims()
    env = {**os.environ, "CKPTD_TEST_CRIU": ctx.criu, "CKPTD_TEST_TORCH_PYTHON": sys.executable}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           "tests/gpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=max(ctx.left() - 5, 5), check=False)
    (ctx.work / "tests_gpu.log").write_text(proc.stdout + proc.stderr)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["no output"]
    res.note = tail[0][:300]
    if proc.returncode not in (0, 5):
        raise AssertionError(f"pytest exited {proc.returncode}: {res.note}; "
                             + (proc.stdout + proc.stderr)[-1200:])


def copy_rates(ctx: Context, nbytes: int) -> dict[str, float]:
    """GB/s of plain device-to-host and host-to-device copies of ``nbytes`` (pageable and
    pinned host memory), measured by torch in a separate process."""
    device = "cpu" if ctx.dry_run else "cuda"
    code = f"""
import json, sys, time, torch
n = {nbytes}
dev = torch.device({device!r})
d = torch.ones(n, dtype=torch.uint8, device=dev)
out = {{}}
for kind, pin in (("pageable", False), ("pinned", {not ctx.dry_run})):
    h = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    h.copy_(d)
    if dev.type == "cuda": torch.cuda.synchronize()
    t = time.perf_counter(); h.copy_(d)
    if dev.type == "cuda": torch.cuda.synchronize()
    out["d2h_" + kind] = n / (time.perf_counter() - t) / 1e9
    t = time.perf_counter(); d.copy_(h)
    if dev.type == "cuda": torch.cuda.synchronize()
    out["h2d_" + kind] = n / (time.perf_counter() - t) / 1e9
    del h
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=max(min(ctx.left(), 180), 5), check=False)
    if proc.returncode != 0:
        raise AssertionError(f"copy benchmark failed: {proc.stderr.strip()[-800:]}")
    return {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


class StepTimes:
    """Arrival times of a job's step lines (its stdout on a pipe): the longest gap, less the
    interval, is how long the whole job was frozen."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.times: list[float] = []
        self.lines: list[str] = []
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)),
                   default=0.0)


def size_figures(gib: int) -> Callable[[Context, Result], None]:
    def body(ctx: Context, res: Result) -> None:
        daemon = ctx.need_daemon()
        mib = gib * 1024
        nbytes = mib * MIB if not ctx.dry_run else 64 * MIB
        steps, interval_ms = (8, 100) if ctx.dry_run else (12, 200)
        proc = subprocess.Popen(
            ctx.fill_cmd(steps, interval_ms, mib), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **ctx.env(nbytes)},
        )
        times = StepTimes(proc)
        try:
            wait_until(lambda: len(times.lines) >= 3, 180, "3 step lines of fill")
            ck = daemon.ctl("dump", proc.pid, "--leave-running", timeout=600)
            record_gpu(res, ck)
            proc.wait(timeout=max(ctx.left() - 5, 5))  # finishes by itself (issue 53)
        finally:
            if proc.poll() is None and ctx.dry_run:
                proc.kill()
                proc.wait()
            elif proc.poll() is None:  # through the driver's checkpoint: end it by one
                with contextlib.suppress(Exception):
                    daemon.ctl("dump", proc.pid, timeout=300)
                proc.poll()
        gpu = ck["gpu"]
        frozen = times.max_gap() - interval_ms / 1000.0
        parts = sum(float(gpu.get(k, 0.0)) for k in ("lock_s", "checkpoint_s", "restore_s",
                                                      "unlock_s")) + float(ck["frozen_s"])
        res.figure("device_bytes", nbytes, "B")
        res.figure("job_frozen_s", round(frozen, 3), "s")
        res.figure("sum_of_parts_s", round(parts, 3), "s")
        cp, rs = float(gpu.get("checkpoint_s", 0.0)), float(gpu.get("restore_s", 0.0))
        if cp > 0:
            res.figure("checkpoint_d2h_GBps", round(nbytes / cp / 1e9, 2), "GB/s")
        if rs > 0:
            res.figure("restore_h2d_GBps", round(nbytes / rs / 1e9, 2), "GB/s")
        for key, value in copy_rates(ctx, nbytes).items():
            res.figure(f"memcpy_{key}_GBps", round(value, 2), "GB/s")
        with contextlib.suppress(Exception):
            daemon.ctl("delete", ck["id"], timeout=120)
            daemon.ctl("gc", timeout=300)
        res.note = (f"{gib} GiB: frozen {frozen:.2f}s vs parts {parts:.2f}s"
                    + (" (dry run: 64 MiB CPU job, fake GPU times)" if ctx.dry_run else ""))
    return body


def infer_second_checkpoint(ctx: Context, res: Result) -> None:
    daemon = ctx.need_daemon()
    steps, interval_ms = (12, 100) if ctx.dry_run else (40, 250)
    job = Job(ctx, "infer", ctx.infer_cmd(steps, interval_ms), ctx.env(ctx.infer_mib * MIB))
    job.wait_steps(3, timeout=240)
    first = daemon.ctl("dump", job.pid, "--leave-running", timeout=600)
    job.restored = True  # restored in place by the driver: never SIGKILL it (issue 53)
    job.wait_steps(step_lines(job.out) + 2, timeout=120)
    second = daemon.ctl("dump", job.pid, "--leave-running", timeout=600)
    ratio = int(second["bytes_new"]) / max(int(first["bytes_new"]), 1)
    res.figure("weights", ctx.infer_mib * MIB, "B")
    res.figure("first_bytes_new", int(first["bytes_new"]), "B")
    res.figure("second_bytes_new", int(second["bytes_new"]), "B")
    res.figure("second_bytes_logical", int(second["bytes_logical"]), "B")
    res.figure("second_new_ratio", round(100 * ratio, 3), "%")
    res.figure("second_dump_s", round(float(second["duration_s"]), 3), "s")
    job.wait_done(max(ctx.left() - 5, 5))  # let it finish by itself (issue 53)
    for ck in (first, second):
        with contextlib.suppress(Exception):
            daemon.ctl("delete", ck["id"], timeout=120)
    with contextlib.suppress(Exception):
        daemon.ctl("gc", timeout=300)
    res.note = f"second checkpoint stored {100 * ratio:.2f}% new bytes (limit 5%)"
    if ratio > 0.05:
        raise AssertionError(res.note)


# ---- set-up, report ---------------------------------------------------------------------------


def kernel_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"kernel": platform.release(), "machine": platform.machine(),
                             "python": platform.python_version()}
    facts["ns_last_pid_writable"] = os.access("/proc/sys/kernel/ns_last_pid", os.W_OK)
    try:
        fd = os.pidfd_open(os.getpid())
        os.close(fd)
        facts["pidfd_open"] = True
    except (AttributeError, OSError):
        facts["pidfd_open"] = False
    facts["cgroup2"] = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    for name in ("yama/ptrace_scope", "io_uring_disabled", "pid_max"):
        with contextlib.suppress(OSError):
            facts[name] = Path(f"/proc/sys/kernel/{name}").read_text().strip()
    with contextlib.suppress(OSError):
        facts["soft_dirty_in_pagemap"] = Path("/proc/self/clear_refs").exists()
    return facts


def setup(ctx: Context, res: Result) -> None:
    ctx.facts.update(kernel_facts())
    if ctx.dry_run:
        if not (WORKLOADS_BIN / "counter").exists():
            subprocess.run(["make", "-C", str(REPO / "native" / "workloads")], check=True,
                           capture_output=True, timeout=120)
    else:
        build = subprocess.run(["make", "-C", str(GPU_DIR)], capture_output=True, text=True,
                               timeout=180, check=False)
        if build.returncode != 0 or not (GPU_DIR / "bin" / "fill").exists():
            raise AssertionError(f"make -C native/gpu: {build.stdout[-500:]}"
                                 f"{build.stderr[-1000:]}")
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=60, check=False)
            ctx.facts["gpus"] = q.stdout.strip()
        import torch

        ctx.facts["torch"] = f"{torch.__version__} cuda {torch.version.cuda}"
    ctx.daemon = Daemon(ctx)
    ctx.daemon.start()
    check = subprocess.run(ctx.daemon.ctl_argv("check"), capture_output=True, text=True,
                           timeout=120, check=False)
    with contextlib.suppress(ValueError):
        ctx.facts["ckptctl_check"] = json.loads(check.stdout)
    res.note = f"ckptd serving (CRIU {ctx.criu}); facts: {len(ctx.facts)}"


def write_report(ctx: Context, started: float) -> None:
    ctx.out.mkdir(parents=True, exist_ok=True)
    data = {
        "dry_run": ctx.dry_run,
        "criu": ctx.criu,
        "duration_s": round(time.monotonic() - started, 2),
        "facts": ctx.facts,
        "checks": [
            {"name": r.name, "what": r.what, "status": r.status, "seconds": r.seconds,
             "note": r.note, "figures": r.figures}
            for r in ctx.results
        ],
    }
    (ctx.out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    md = [f"# ckptd device check{' (dry run)' if ctx.dry_run else ''}", "",
          f"Duration: {data['duration_s']} s. CRIU: `{ctx.criu}`. "
          f"Kernel: {ctx.facts.get('kernel', '?')}.", "",
          "| check | result | time (s) | note |", "|---|---|---|---|"]
    for r in ctx.results:
        note = r.note.replace("|", "/").replace("\n", " ")[:300]
        md.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {note} |")
    md += ["", "## Figures", ""]
    for r in ctx.results:
        if r.figures:
            md += [f"### {r.name}", "", "| figure | value | unit |", "|---|---|---|"]
            md += [f"| {k} | {v['value']} | {v['unit']} |" for k, v in r.figures.items()]
            md.append("")
    md += ["## Facts", "", "```", json.dumps(
        {k: v for k, v in ctx.facts.items() if k != "ckptctl_check"}, indent=2, default=str),
        "```", ""]
    (ctx.out / "report.md").write_text("\n".join(md))
    if ctx.daemon is not None and ctx.daemon.log_path.exists():
        with open(ctx.daemon.log_path, "rb") as src:
            src.seek(max(ctx.daemon.log_path.stat().st_size - 8 * MIB, 0))
            (ctx.out / "daemon.log").write_bytes(src.read())
    tests_log = ctx.work / "tests_gpu.log"
    if tests_log.exists():
        shutil.copyfile(tests_log, ctx.out / "tests_gpu.log")


def table(ctx: Context, started: float) -> str:
    rows = [("check", "result", "s", "note")]
    rows += [(r.name, r.status, f"{r.seconds:.1f}", r.note[:70]) for r in ctx.results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = [" ".join(row[i].ljust(widths[i]) for i in range(3)) + " " + row[3] for row in rows]
    failed = sum(r.status == "FAIL" for r in ctx.results)
    out.append(f"{len(ctx.results)} checks, {failed} failed, "
               f"{time.monotonic() - started:.0f}s; report in {ctx.out}")
    return "\n".join(out)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="device_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: CPU jobs and a fake GPU in the daemon")
    parser.add_argument("--criu", default="", help="CRIU binary (default: the bundle's)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="the whole run's time limit (s)")
    parser.add_argument("--sizes-gib", default="1,8",
                        help="device memory sizes of the figures (GiB, comma-separated)")
    parser.add_argument("--infer-mib", type=int, default=0,
                        help="weights of the inference job (default 8192, 64 in a dry run)")
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch directory (default /tmp/ckptd-device-check)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    criu = args.criu or next((str(p) for p in DEFAULT_CRIU if os.access(p, os.X_OK)),
                             shutil.which("criu") or "criu")
    work = args.work or Path("/tmp/ckptd-device-check")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ctx = Context(
        out=args.outdir, work=work, dry_run=args.dry_run, criu=criu,
        deadline=started + args.budget_s - TESTS_GPU_RESERVE_S,
        sizes_gib=[int(s) for s in args.sizes_gib.split(",") if s.strip()],
        infer_mib=args.infer_mib or (64 if args.dry_run else 8192),
        control=work / "control",
    )
    ctx.control.mkdir()
    try:
        steps: list[tuple[str, str, float, Callable[[Context, Result], None], bool]] = [
            ("setup", "build native/gpu, start ckptd, kernel facts", 240, setup, False),
            ("train_stop", "train.py: stop-mode dump mid-run, restore, same lines",
             120, stop_mode("train"), False),
            ("train_leave_running_kill", "train.py: leave-running dump, SIGKILL, restore",
             120, leave_running_sigkill, False),
            ("fill_raw_cuda", "fill (raw CUDA, 256 MiB): dump, restore, buffer checksum",
             120, stop_mode("fill"), False),
            ("dataloader_workers", "train_loader.py (2 CPU workers): dump, restore",
             120, stop_mode("loader"), False),
            ("identity_remap", "fill: restore with CUcheckpointRestoreArgs, identity map",
             120, identity_remap, False),
            ("memory_cgroup_refusal", "fill in a memory cgroup without room: refused, runs on",
             90, memory_cgroup_refusal, False),
            ("daemon_killed_after_lock", "SIGKILL ckptd after the lock, restart: job runs on",
             150, daemon_killed_after("lock"), False),
            ("daemon_killed_after_checkpoint", "SIGKILL ckptd after the device checkpoint",
             150, daemon_killed_after("checkpoint"), False),
        ]
        steps += [(f"figures_{g}gib", f"phase times and GB/s, fill of {g} GiB", 150,
                   size_figures(g), False) for g in ctx.sizes_gib]
        steps += [
            ("infer_second_checkpoint", "second checkpoint of 8 GiB unchanging weights <= 5%",
             150, infer_second_checkpoint, False),
        ]
        for name, what, limit, body, gpu_only in steps:
            run_step(ctx, name, what, limit, body, gpu_only)
            if name == "setup" and ctx.results[-1].status != "pass":
                break
        if ctx.daemon is not None:  # tests/gpu start daemons of their own
            ctx.daemon.stop()
        ctx.deadline = started + args.budget_s  # the reserve is for tests/gpu
        run_step(ctx, "tests_gpu", "pytest tests/gpu against the driver", 200, tests_gpu)
    finally:
        if ctx.daemon is not None:
            rc = ctx.daemon.stop()
            log(f"ckptd stopped (exit {rc})")
        write_report(ctx, started)
        log("")
        log(table(ctx, started))
    return 1 if any(r.status == "FAIL" for r in ctx.results) else 0


if __name__ == "__main__":
    sys.exit(main())
