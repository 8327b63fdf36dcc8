"""The ``cuda-checkpoint`` utility as a backend of ``CudaDriverCheckpointer`` (fallback).

Used only when the Python bindings cannot be (not installed, older than 12.8, or a driver
without the driver API: r550-r565). The utility exposes what the installed driver can do:

- ``--get-state --pid P`` prints ``running``, ``locked``, ``checkpointed`` or ``failed``;
- ``--get-restore-tid --pid P`` prints the restore thread id, exit status non-zero for a
  process without CUDA;
- ``--action lock|checkpoint|restore|unlock --pid P [--timeout MS]``: with drivers that have
  the driver API (r570 on; CRIU's CUDA plugin detects it in ``cuda-checkpoint -h``);
- ``--toggle --pid P``: older drivers (r550-r565): RUNNING -> CHECKPOINTED (lock and
  checkpoint in one) or back (restore and unlock in one).

With only ``--toggle`` this backend keeps LOCKED as a state of its own: ``lock`` checks the
process runs and remembers it, ``checkpoint`` toggles, ``restore`` toggles back (the process
runs on at once and reads as LOCKED until ``unlock``, which only forgets it). The lock
timeout cannot be honoured then.

Restoring onto other GPUs is refused (``remap_refusal``, asked at restore planning, before
CRIU touches anything): r580's utility has ``--device-map``, but its syntax and semantics
are not verified here, and a remap needs the bindings anyway (cuda-bindings >= 13.0.2).
(Unverified on hardware: the toggle-only path and the exact output of old utilities.)

``--get-restore-tid`` failing is "no CUDA" only when its output names no CUDA error or one
of ``NO_CUDA_CODES`` — by name or by the ``cuGetErrorString`` text the utility prints
(``ERROR_TEXTS``); any other error is raised (never read as "no CUDA"). Queries are
killed after ``QUERY_TIMEOUT_S``; a checkpoint or restore never is (killing it half-way
could leave the driver out of sync): the adapter's worker bounds the wait instead and
abandons it (``ckptd.adapters.cuda.worker``).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence

from ckptd.domain import CudaState
from ckptd.errors import GpuFailed, GpuUnavailable

Runner = Callable[[Sequence[str], float | None], tuple[int, str]]
"""Runs argv with a timeout (None: none); returns (exit status, stdout and stderr)."""

QUERY_TIMEOUT_S = 60.0
_STATES = {
    "running": CudaState.RUNNING,
    "locked": CudaState.LOCKED,
    "checkpointed": CudaState.CHECKPOINTED,
    "failed": CudaState.FAILED,
}
_CUDA_ERROR = re.compile(r"CUDA_ERROR_[A-Z_]+")
ERROR_TEXTS = {
    "invalid argument": "CUDA_ERROR_INVALID_VALUE",
    "named symbol not found": "CUDA_ERROR_NOT_FOUND",
    "the operation cannot be performed in the present state": "CUDA_ERROR_ILLEGAL_STATE",
    "device not ready": "CUDA_ERROR_NOT_READY",
    "os call failed or operation not supported on this os": "CUDA_ERROR_OPERATING_SYSTEM",
    "operation not supported": "CUDA_ERROR_NOT_SUPPORTED",
    "operation not permitted": "CUDA_ERROR_NOT_PERMITTED",
    "out of memory": "CUDA_ERROR_OUT_OF_MEMORY",
    "initialization error": "CUDA_ERROR_NOT_INITIALIZED",
    "no cuda-capable device is detected": "CUDA_ERROR_NO_DEVICE",
    "wait operation timed out": "CUDA_ERROR_TIMEOUT",
    "unknown error": "CUDA_ERROR_UNKNOWN",
}
"""``cuGetErrorString`` text -> error name. The utility prints the driver's error *string*
(e.g. "invalid argument"), not the CUDA_ERROR_* name (NVIDIA/cuda-checkpoint README's
examples; the strings are those of the CUDA driver API's ``cuGetErrorString``): both are
recognised. Longest first, so "os call failed or operation not supported..." wins over
"operation not supported"."""
NO_CUDA_CODES = frozenset(
    {"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NOT_INITIALIZED"}
)
"""As ``ckptd.adapters.cuda.bindings.NO_CUDA_CODES``: the probe's "no CUDA context"."""


def run_subprocess(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
    """The default ``Runner``: ``subprocess.run`` with stderr folded into stdout."""
    proc = subprocess.run(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout


class CudaCheckpointBinary:
    """Backend over the ``cuda-checkpoint`` executable at ``path`` (see the module doc)."""

    name = "cuda-checkpoint"

    def __init__(self, path: str, run: Runner = run_subprocess) -> None:
        self.path = path
        self._run_argv = run
        self._has_actions: bool | None = None
        self._locked: set[int] = set()
        """Toggle mode: processes this backend holds as LOCKED."""

    @property
    def has_actions(self) -> bool:
        """Whether the utility has ``--action`` (asked once, from ``-h``)."""
        if self._has_actions is None:
            _, out = self._run(["-h"], QUERY_TIMEOUT_S, "cuda-checkpoint -h", 0)
            self._has_actions = "--action" in out
        return self._has_actions

    def describe(self) -> str:
        mode = "--action" if self.has_actions else "--toggle"
        return f"{self.path} ({mode})"

    # ---- the backend interface ---------------------------------------------------------------

    def restore_tid(self, pid: int) -> int | None:
        rc, out = self._run(
            ["--get-restore-tid", "--pid", str(pid)], QUERY_TIMEOUT_S, "--get-restore-tid", pid
        )
        if rc != 0:
            code = error_code(out)
            if code is None or code in NO_CUDA_CODES:
                return None
            raise self._failed(
                f"cuda-checkpoint --get-restore-tid (cannot tell whether pid {pid} uses CUDA)",
                pid, rc, out,
            )
        try:
            return int(out.split()[0])
        except (IndexError, ValueError):
            return None

    def state(self, pid: int) -> CudaState:
        call = "cuda-checkpoint --get-state"
        rc, out = self._run(["--get-state", "--pid", str(pid)], QUERY_TIMEOUT_S, call, pid)
        if rc != 0:
            raise self._failed(call, pid, rc, out)
        words = out.split()
        word = words[0].lower() if words else ""
        if word not in _STATES:
            raise GpuFailed(
                f"{call} for pid {pid} failed: unknown state {out.strip()!r}",
                call=call,
                code="UNKNOWN_STATE",
                pid=pid,
            )
        state = _STATES[word]
        if state is CudaState.RUNNING and pid in self._locked:
            return CudaState.LOCKED
        return state

    def lock(self, pid: int, timeout_ms: int) -> None:
        if self.has_actions:
            extra = ["--timeout", str(timeout_ms)] if timeout_ms > 0 else []
            budget = timeout_ms / 1000 + QUERY_TIMEOUT_S if timeout_ms > 0 else None
            self._action("lock", pid, extra, budget)
            return
        self._expect(pid, CudaState.RUNNING, "lock")
        self._locked.add(pid)

    def checkpoint(self, pid: int) -> None:
        if self.has_actions:
            self._action("checkpoint", pid)
            return
        self._expect(pid, CudaState.LOCKED, "checkpoint")
        self._toggle(pid, "checkpoint")
        self._locked.discard(pid)

    def remap_refusal(self) -> str | None:
        """Always a reason: this backend never restores onto other GPUs (module doc)."""
        return (
            "ckptd's cuda-checkpoint fallback does not restore onto other GPUs (its "
            "--device-map is not supported by ckptd): install cuda-bindings >= 13.0.2 with "
            "an r580 / CUDA 13.0 driver"
        )

    def restore(self, pid: int, gpu_map: dict[str, str] | None) -> None:
        if gpu_map:
            raise GpuUnavailable(str(self.remap_refusal()), pid=pid)
        if self.has_actions:
            self._action("restore", pid)
            return
        self._expect(pid, CudaState.CHECKPOINTED, "restore")
        self._toggle(pid, "restore")
        self._locked.add(pid)

    def unlock(self, pid: int) -> None:
        if self.has_actions:
            self._action("unlock", pid)
            return
        self._expect(pid, CudaState.LOCKED, "unlock")
        self._locked.discard(pid)

    def forget(self, pid: int) -> None:
        """The process is gone: drop what this backend remembers of it."""
        self._locked.discard(pid)

    # ---- internals -----------------------------------------------------------------------

    def _expect(self, pid: int, want: CudaState, what: str) -> None:
        have = self.state(pid)
        if have is not want:
            call = f"cuda-checkpoint {what}"
            raise GpuFailed(
                f"{call} for pid {pid} failed: CUDA_ERROR_ILLEGAL_STATE "
                f"(the process is {have.name}, not {want.name})",
                call=call,
                code="CUDA_ERROR_ILLEGAL_STATE",
                pid=pid,
            )

    def _action(
        self, action: str, pid: int, extra: Sequence[str] = (), timeout: float | None = None
    ) -> None:
        call = f"cuda-checkpoint --action {action}"
        rc, out = self._run(["--action", action, "--pid", str(pid), *extra], timeout, call, pid)
        if rc != 0:
            raise self._failed(call, pid, rc, out)

    def _toggle(self, pid: int, what: str) -> None:
        call = f"cuda-checkpoint --toggle ({what})"
        rc, out = self._run(["--toggle", "--pid", str(pid)], None, call, pid)
        if rc != 0:
            raise self._failed(call, pid, rc, out)

    def _run(
        self, args: Sequence[str], timeout: float | None, call: str, pid: int
    ) -> tuple[int, str]:
        argv = [self.path, *args]
        try:
            return self._run_argv(argv, timeout)
        except subprocess.TimeoutExpired as exc:
            raise GpuFailed(
                f"{call} for pid {pid} failed: no answer within {timeout:g}s",
                call=call,
                code="TIMEOUT",
                pid=pid or None,
            ) from exc
        except OSError as exc:
            raise GpuUnavailable(
                f"cannot run {self.path}: {exc.strerror or exc}", pid=pid or None
            ) from exc

    @staticmethod
    def _failed(call: str, pid: int, rc: int, out: str) -> GpuFailed:
        code = error_code(out) or f"EXIT_{rc}"
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        detail = f" ({lines[-1]})" if lines and lines[-1] != code else ""
        return GpuFailed(
            f"{call} for pid {pid} failed: {code}{detail}", call=call, code=code, pid=pid
        )


def error_code(out: str) -> str | None:
    """The CUDA error the utility's output names, by name or by ``cuGetErrorString`` text
    (``ERROR_TEXTS``); None when it names none."""
    found = _CUDA_ERROR.search(out)
    if found is not None:
        return found.group()
    lowered = out.lower()
    for text in sorted(ERROR_TEXTS, key=len, reverse=True):
        if text in lowered:
            return ERROR_TEXTS[text]
    return None
