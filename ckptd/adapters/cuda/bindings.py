"""``DriverApi``: the backend of ``CudaDriverCheckpointer`` over ``cuda.bindings.driver``.

Everything that touches the bindings' types is here, so that one place decides what a given
cuda-bindings version can do — by looking for the names themselves, never by the version
alone (13.3.0 has ``CUcheckpointGpuPair`` and the functions but no
``CUcheckpointRestoreArgs``; 13.0.0/13.0.1 lack ``cuCheckpointProcessRestore``).

Invariants: no method lets a foreign exception out — a driver error becomes ``GpuFailed``
(``call``, ``code`` = the error's name, ``pid``), a missing name or an argument the bindings
refuse becomes ``GpuUnavailable`` / ``GpuFailed`` with the original as ``__cause__``;
``build_*`` make the argument structs exactly as the calls pass them (the contract test builds
them against every supported cuda-bindings version, no driver needed).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
from typing import Any

from ckptd.adapters.cuda.support import (
    BINDINGS_12_PIP,
    BINDINGS_13_DRIVER,
    GIL_RELEASE_BINDINGS,
    GPU_REMAP_BINDINGS,
    GPU_REMAP_DRIVER,
    format_cuda_version,
    parse_version,
    process_state,
    uuid_to_bytes,
)
from ckptd.domain import CudaState
from ckptd.errors import CkptdError, GpuFailed, GpuUnavailable

CHECKPOINT_FUNCTIONS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
REMAP_STRUCTS = ("CUcheckpointRestoreArgs", "CUcheckpointGpuPair", "CUuuid")
"""The types a restore onto other GPUs builds (all three must exist)."""
NO_CUDA_CODES = frozenset(
    {"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NOT_INITIALIZED"}
)
"""Errors of ``cuCheckpointProcessGetRestoreThreadId`` that mean "this process has no CUDA
context". NOT_INITIALIZED is the driver's answer (seen on an H100, driver 580.159, the
daemon's own cuInit done) for a process that never initialised CUDA itself: every CPU-only
process, and a child forked from a CUDA process (a DataLoader worker), which inherits its
parent's /dev/nvidia* mappings but has no context of its own — CUDA does not survive fork;
CRIU's cuda_plugin reads any --get-restore-tid failure so too. Any other error (no
permission, OS error...) is a failure to tell, raised as such: never read as "no CUDA"."""
MAX_LOCK_TIMEOUT_MS = 0xFFFFFFFF
"""``CUcheckpointLockArgs.timeoutMs`` is an unsigned int."""


def bindings_version() -> str:
    """The installed cuda-bindings version ("" when unknown)."""
    try:
        return importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module("cuda.bindings")
    except ImportError:
        return ""
    return str(getattr(module, "__version__", ""))


def _unversioned(version: str) -> str:
    return version or "(unknown version)"


def gil_refusal(version: str) -> str | None:
    """Why cuda-bindings ``version`` must not serve the daemon (it holds the GIL during
    driver calls, so a long checkpoint would stop every Python thread, the systemd watchdog
    ping included); None when it may (or the version is unknown)."""
    parsed = parse_version(version)
    if parsed and parsed < GIL_RELEASE_BINDINGS:
        need = ".".join(map(str, GIL_RELEASE_BINDINGS))
        return (
            f"cuda-bindings {version} holds the GIL during driver calls (released from "
            f"{need} on): a long checkpoint would stall the daemon and its watchdog ping; "
            f"needs cuda-bindings >= {need}"
        )
    return None


def driver_refusal(version: str, driver_version: int) -> str | None:
    """Why cuda-bindings ``version`` cannot serve on a driver of CUDA ``driver_version``
    (``cuDriverGetVersion``): 13.x needs r580 / CUDA 13.0 (580.65.06); one line ending in
    the pip command that fixes it. None when it can (or the version is unknown)."""
    parsed = parse_version(version)
    if parsed[:1] == (13,) and driver_version < BINDINGS_13_DRIVER:
        return (
            f"cuda-bindings {version} needs an NVIDIA driver r580 (580.65.06) or newer, this "
            f"driver is CUDA {format_cuda_version(driver_version)}: {BINDINGS_12_PIP}"
        )
    return None


class DriverApi:
    """Backend over ``cuda.bindings.driver`` (or any object with its API, for tests)."""

    name = "cuda.bindings"

    def __init__(self, cu: Any, driver_version: int, version: str) -> None:
        self.cu = cu
        self.driver_version = driver_version
        self.bindings_version = version

    def describe(self) -> str:
        return (
            f"cuda-bindings {_unversioned(self.bindings_version)}, "
            f"driver CUDA {format_cuda_version(self.driver_version)}"
        )

    # ---- calls -------------------------------------------------------------------------------

    def restore_tid(self, pid: int) -> int | None:
        """The restore thread of ``pid``; None only for the errors of ``NO_CUDA_CODES``."""
        call = "cuCheckpointProcessGetRestoreThreadId"
        result = self._invoke(call, pid, pid)
        if result[0] == self.cu.CUresult.CUDA_SUCCESS:
            return int(result[1])
        name = self.error_name(result[0])
        if name in NO_CUDA_CODES:
            return None
        raise GpuFailed(
            f"cannot tell whether pid {pid} uses CUDA: {call} failed: {name}",
            call=call,
            code=name,
            pid=pid,
        )

    def state(self, pid: int) -> CudaState:
        call = "cuCheckpointProcessGetState"
        value = self._check(call, pid, self._invoke(call, pid, pid))[0]
        raw = int(getattr(value, "value", value))
        try:
            return process_state(raw)
        except ValueError:
            name = getattr(value, "name", str(raw))
            raise GpuFailed(
                f"{call} for pid {pid} failed: unexpected state {name}",
                call=call,
                code=str(name),
                pid=pid,
            ) from None

    def lock(self, pid: int, timeout_ms: int) -> None:
        call = "cuCheckpointProcessLock"
        self._check(call, pid, self._invoke(call, pid, pid, self.build_lock_args(timeout_ms, pid)))

    def checkpoint(self, pid: int) -> None:
        call = "cuCheckpointProcessCheckpoint"
        self._check(call, pid, self._invoke(call, pid, pid, None))

    def restore(self, pid: int, gpu_map: dict[str, str] | None) -> None:
        call = "cuCheckpointProcessRestore"
        args = self.build_restore_args(gpu_map, pid) if gpu_map else None
        self._check(call, pid, self._invoke(call, pid, pid, args))

    def unlock(self, pid: int) -> None:
        call = "cuCheckpointProcessUnlock"
        self._check(call, pid, self._invoke(call, pid, pid, None))

    # ---- argument structs ---------------------------------------------------------------------

    def build_lock_args(self, timeout_ms: int, pid: int = 0) -> Any:
        """``CUcheckpointLockArgs`` with ``timeoutMs``. A negative timeout is refused (the
        driver's 0 means "wait forever": never what a negative number meant)."""
        call = "cuCheckpointProcessLock"
        if timeout_ms < 0 or timeout_ms > MAX_LOCK_TIMEOUT_MS:
            raise GpuFailed(
                f"{call} for pid {pid} refused: lock timeout {timeout_ms} ms is out of range "
                f"(0 = no limit .. {MAX_LOCK_TIMEOUT_MS})",
                call=call,
                code="INVALID_TIMEOUT",
                pid=pid or None,
            )
        args = self._make(call, "CUcheckpointLockArgs", pid)
        return self._set(call, pid, lambda: setattr(args, "timeoutMs", int(timeout_ms)), args)

    def build_restore_args(self, gpu_map: dict[str, str], pid: int = 0) -> Any:
        """``CUcheckpointRestoreArgs`` holding one ``CUcheckpointGpuPair`` per entry of
        ``gpu_map`` (sorted by old UUID). Raises ``GpuUnavailable`` when driver or bindings
        cannot remap (``remap_refusal``), ``GpuFailed`` code ``INVALID_UUID`` for a bad UUID."""
        self.check_remap(pid)
        call = "cuCheckpointProcessRestore"
        pairs = [self.gpu_pair(old, new, pid) for old, new in sorted(gpu_map.items())]
        args = self._make(call, "CUcheckpointRestoreArgs", pid)

        def fill() -> None:
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)

        return self._set(call, pid, fill, args)

    def gpu_pair(self, old: str, new: str, pid: int = 0) -> Any:
        call = "cuCheckpointProcessRestore"
        pair = self._make(call, "CUcheckpointGpuPair", pid)
        try:
            old_uuid, new_uuid = self.cu_uuid(old), self.cu_uuid(new)
        except ValueError as exc:
            raise GpuFailed(
                f"{call} for pid {pid} failed: {exc}", call=call, code="INVALID_UUID",
                pid=pid or None,
            ) from exc

        def fill() -> None:
            pair.oldUuid = old_uuid
            pair.newUuid = new_uuid

        return self._set(call, pid, fill, pair)

    def cu_uuid(self, text: str) -> Any:
        """A ``CUuuid`` holding the GPU UUID ``text`` (its ``bytes`` is read-only: filled
        through ``ctypes.memmove`` on ``getPtr()``). Raises ValueError for a bad UUID."""
        raw = uuid_to_bytes(text)
        value = self._make("cuCheckpointProcessRestore", "CUuuid", 0)
        ctypes.memmove(value.getPtr(), raw, len(raw))
        got = getattr(value, "bytes", raw)
        if isinstance(got, (bytes, bytearray)) and bytes(got) != raw:
            raise ValueError(f"CUuuid for {text} holds {bytes(got).hex()} after memmove")
        return value

    # ---- remap -------------------------------------------------------------------------------

    def remap_refusal(self) -> str | None:
        """Why this driver and these bindings cannot restore onto other GPUs; None: they
        can. Looks for the types themselves (module doc)."""
        if self.driver_version < GPU_REMAP_DRIVER:
            return (
                "restoring onto other GPUs needs an r580 / CUDA 13.0 driver; this driver is "
                f"CUDA {format_cuda_version(self.driver_version)}"
            )
        missing = [n for n in (*REMAP_STRUCTS, "cuCheckpointProcessRestore")
                   if not hasattr(self.cu, n)]
        version = parse_version(self.bindings_version)
        if missing or (version and version < GPU_REMAP_BINDINGS):
            lacks = f" (it lacks {', '.join(missing)})" if missing else ""
            return (
                f"restoring onto other GPUs needs cuda-bindings >= 13.0.2 with "
                f"CUcheckpointRestoreArgs; installed: {_unversioned(self.bindings_version)}"
                f"{lacks}"
            )
        return None

    def check_remap(self, pid: int = 0) -> None:
        """Raise ``GpuUnavailable`` unless driver and bindings can restore onto other GPUs."""
        reason = self.remap_refusal()
        if reason is not None:
            raise GpuUnavailable(
                reason, hint="pip install -U 'cuda-bindings>=13.4.4'", pid=pid or None
            )

    # ---- errors ------------------------------------------------------------------------------

    def error_name(self, err: Any) -> str:
        """``cuGetErrorName(err)``, else the enum's name, else the number."""
        try:
            status, name = self.cu.cuGetErrorName(err)
        except Exception:
            status, name = None, None
        if status == self.cu.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
        fallback = getattr(err, "name", None)
        if fallback:
            return str(fallback)
        try:
            return f"CUresult {int(err)}"
        except (TypeError, ValueError):
            return f"CUresult {err!r}"

    def _make(self, call: str, type_name: str, pid: int) -> Any:
        """A new ``cu.<type_name>()``; ``GpuUnavailable`` naming the version when the
        bindings lack it."""
        kind = getattr(self.cu, type_name, None)
        if kind is None:
            raise GpuUnavailable(
                f"{call} for pid {pid} cannot be made: cuda-bindings "
                f"{_unversioned(self.bindings_version)} has no {type_name}",
                hint="pip install -U 'cuda-bindings>=13.4.4'",
                pid=pid or None,
            )
        try:
            return kind()
        except Exception as exc:
            raise GpuUnavailable(
                f"{call} for pid {pid}: cuda-bindings {_unversioned(self.bindings_version)} "
                f"cannot make {type_name}: {type(exc).__name__}: {exc}",
                pid=pid or None,
            ) from exc

    def _set(self, call: str, pid: int, fill: Any, value: Any) -> Any:
        """Run ``fill()`` (sets fields of ``value``); a refusal of the bindings (TypeError,
        AttributeError, OverflowError...) becomes ``GpuUnavailable``."""
        try:
            fill()
        except CkptdError:
            raise
        except Exception as exc:
            raise GpuUnavailable(
                f"{call} for pid {pid}: cuda-bindings {_unversioned(self.bindings_version)} "
                f"refused an argument: {type(exc).__name__}: {exc}",
                pid=pid or None,
            ) from exc
        return value

    def _invoke(self, call: str, pid: int, *args: Any) -> tuple[Any, ...]:
        function = getattr(self.cu, call, None)
        if function is None:
            raise GpuUnavailable(
                f"cuda-bindings {_unversioned(self.bindings_version)} has no {call}", pid=pid
            )
        try:
            result = function(*args)
        except RuntimeError as exc:  # "Function ... not found", no libcuda.so.1: the driver
            raise GpuUnavailable(
                f"the NVIDIA driver cannot do {call}: {exc}", pid=pid or None
            ) from exc
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:  # arguments refused
            raise GpuUnavailable(
                f"cuda-bindings {_unversioned(self.bindings_version)} refused {call}'s "
                f"arguments: {type(exc).__name__}: {exc}",
                pid=pid or None,
            ) from exc
        return result if isinstance(result, tuple) else (result,)

    def _check(self, call: str, pid: int, result: tuple[Any, ...]) -> tuple[Any, ...]:
        err = result[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = self.error_name(err)
            raise GpuFailed(f"{call} for pid {pid} failed: {name}", call=call, code=name, pid=pid)
        return result[1:]
