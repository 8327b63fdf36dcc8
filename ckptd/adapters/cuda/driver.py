"""``CudaDriverCheckpointer``: the ``GpuCheckpointer`` port over the CUDA driver's checkpoint API.

Through ``from cuda.bindings import driver as cu`` (package cuda-bindings, pulled in by
``cuda-python``; ``pip install 'ckptd[gpu]'``), imported at first use, never at module import:
ckptd runs without it and without a driver.

Which versions need which (``cuDriverGetVersion()`` is 1000*major + 10*minor):

==============================================  ====================  ==================
what                                            driver                cuda-bindings
==============================================  ====================  ==================
lock / checkpoint / restore / unlock / state    r570, CUDA 12.8       >= 12.8.0
restore onto other GPUs (``gpu_map``)           r580, CUDA 13.0       >= 13.0.2 [#]_
``cuda-checkpoint --action ...`` (fallback)     r570                  (none)
``cuda-checkpoint --toggle`` (fallback)         r550                  (none)
==============================================  ====================  ==================

.. [#] 13.0.0 and 13.0.1 have ``CUcheckpointGpuPair`` but lack ``cuCheckpointProcessRestore``.

The backend is chosen at the first call: the bindings when they import, have every
``cuCheckpointProcess*`` function and the driver says >= 12080; else, when a
``cuda-checkpoint`` executable is on PATH, that (see ``ckptd.adapters.cuda.binary``); else
every call raises ``GpuUnavailable`` saying what is missing. The choice (or the reason
none works) is kept for the adapter's life: restart the daemon after installing a driver.

Invariants:

- every driver call runs on one worker thread owned by the adapter (``close`` ends it): a
  slow checkpoint never runs on a caller's (gRPC) thread, and calls are serialized (the
  bindings release the GIL during driver calls from cuda-bindings 12.9.1 on; before that a
  long checkpoint holds up the daemon's other Python threads);
- ``cuInit(0)`` is called once, on that thread, before any checkpoint call (a restore needs
  it, or persistence mode);
- pids are host pids of processes: a thread id (which the driver would accept and apply to
  its process) is refused with ``GpuFailed`` after a look at ``Tgid`` in /proc/PID/status;
- a driver error becomes ``GpuFailed("<call> for pid <pid> failed: <CUDA_ERROR_NAME>")``
  with ``call``, ``code`` (the error's name from ``cuGetErrorName``) and ``pid``; a missing
  driver function (``RuntimeError`` from the bindings) becomes ``GpuUnavailable``.

``uses_cuda`` is False for a process without a CUDA context, and when no backend works and
the process has no ``/dev/nvidia*`` mapped (no driver, nothing to checkpoint). A process
that does map NVIDIA devices while no backend works raises ``GpuUnavailable``: it cannot be
checkpointed and must not be mistaken for a CPU-only one.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ckptd.adapters.cuda.binary import CudaCheckpointBinary, Runner, run_subprocess
from ckptd.adapters.cuda.support import (
    CHECKPOINT_API_BINDINGS,
    CHECKPOINT_API_DRIVER,
    GPU_REMAP_BINDINGS,
    GPU_REMAP_DRIVER,
    NOT_INSTALLED,
    format_cuda_version,
    maps_nvidia_devices,
    parse_version,
    process_state,
    tgid,
    uuid_to_bytes,
)
from ckptd.domain import CudaState
from ckptd.errors import GpuFailed, GpuUnavailable

T = TypeVar("T")

CHECKPOINT_FUNCTIONS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
DEFAULT_BINARY = "cuda-checkpoint"


class Backend(Protocol):
    """What ``CudaDriverCheckpointer`` needs of a way to reach the driver."""

    def describe(self) -> str: ...

    def restore_tid(self, pid: int) -> int | None:
        """The process's CUDA restore thread; None when it has no CUDA context."""
        ...

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_map: dict[str, str] | None) -> None: ...

    def unlock(self, pid: int) -> None: ...


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


class DriverApi:
    """Backend over ``cuda.bindings.driver`` (or any object with its API, for tests)."""

    name = "cuda.bindings"

    def __init__(self, cu: Any, driver_version: int, version: str) -> None:
        self.cu = cu
        self.driver_version = driver_version
        self.bindings_version = version

    def describe(self) -> str:
        return (
            f"cuda-bindings {self.bindings_version or '(unknown version)'}, "
            f"driver CUDA {format_cuda_version(self.driver_version)}"
        )

    # ---- calls -------------------------------------------------------------------------------

    def restore_tid(self, pid: int) -> int | None:
        result = self._invoke("cuCheckpointProcessGetRestoreThreadId", pid, pid)
        if result[0] != self.cu.CUresult.CUDA_SUCCESS:
            return None
        return int(result[1])

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
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = min(max(0, int(timeout_ms)), 0xFFFFFFFF)  # unsigned int
        call = "cuCheckpointProcessLock"
        self._check(call, pid, self._invoke(call, pid, pid, args))

    def checkpoint(self, pid: int) -> None:
        call = "cuCheckpointProcessCheckpoint"
        self._check(call, pid, self._invoke(call, pid, pid, None))

    def restore(self, pid: int, gpu_map: dict[str, str] | None) -> None:
        call = "cuCheckpointProcessRestore"
        if not gpu_map:
            self._check(call, pid, self._invoke(call, pid, pid, None))
            return
        self.check_remap(pid)
        pairs = [self.gpu_pair(old, new, pid) for old, new in sorted(gpu_map.items())]
        args = self.cu.CUcheckpointRestoreArgs()
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
        self._check(call, pid, self._invoke(call, pid, pid, args))

    def unlock(self, pid: int) -> None:
        call = "cuCheckpointProcessUnlock"
        self._check(call, pid, self._invoke(call, pid, pid, None))

    # ---- GPU pairs ---------------------------------------------------------------------------

    def check_remap(self, pid: int) -> None:
        """Raise ``GpuUnavailable`` unless driver and bindings can restore onto other GPUs."""
        if self.driver_version < GPU_REMAP_DRIVER:
            raise GpuUnavailable(
                f"restoring onto other GPUs needs an r580 / CUDA 13.0 driver; this driver is "
                f"CUDA {format_cuda_version(self.driver_version)}",
                pid=pid,
            )
        version = parse_version(self.bindings_version)
        too_old = bool(version) and version < GPU_REMAP_BINDINGS
        if too_old or not hasattr(self.cu, "CUcheckpointGpuPair"):
            have = self.bindings_version or "an unknown version"
            raise GpuUnavailable(
                f"restoring onto other GPUs needs cuda-bindings >= 13.0.2; installed: {have}",
                hint="pip install -U 'cuda-python>=13.0.2'",
                pid=pid,
            )

    def cu_uuid(self, text: str) -> Any:
        """A ``CUuuid`` holding the GPU UUID ``text`` (its ``bytes`` is read-only: filled
        through ``ctypes.memmove`` on ``getPtr()``)."""
        raw = uuid_to_bytes(text)
        value = self.cu.CUuuid()
        ctypes.memmove(value.getPtr(), raw, len(raw))
        got = getattr(value, "bytes", raw)
        if isinstance(got, (bytes, bytearray)) and bytes(got) != raw:
            raise ValueError(f"CUuuid for {text} holds {bytes(got).hex()} after memmove")
        return value

    def gpu_pair(self, old: str, new: str, pid: int) -> Any:
        call = "cuCheckpointProcessRestore"
        try:
            pair = self.cu.CUcheckpointGpuPair()
            pair.oldUuid = self.cu_uuid(old)
            pair.newUuid = self.cu_uuid(new)
        except ValueError as exc:
            raise GpuFailed(
                f"{call} for pid {pid} failed: {exc}", call=call, code="INVALID_UUID", pid=pid
            ) from exc
        return pair

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

    def _invoke(self, call: str, pid: int, *args: Any) -> tuple[Any, ...]:
        function = getattr(self.cu, call)
        try:
            result = function(*args)
        except RuntimeError as exc:  # "Function ... not found" and the like: driver too old
            raise GpuUnavailable(
                f"the NVIDIA driver cannot do {call}: {exc}", pid=pid or None
            ) from exc
        return result if isinstance(result, tuple) else (result,)

    def _check(self, call: str, pid: int, result: tuple[Any, ...]) -> tuple[Any, ...]:
        err = result[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = self.error_name(err)
            raise GpuFailed(f"{call} for pid {pid} failed: {name}", call=call, code=name, pid=pid)
        return result[1:]


class CudaDriverCheckpointer:
    """The ``GpuCheckpointer`` port (see ``ckptd.core.ports``) over the CUDA driver.

    See the module doc for versions, backends and invariants. Parameters (all for tests or
    unusual set-ups): ``driver``, an object with the API of ``cuda.bindings.driver`` used
    instead of importing it, and ``driver_bindings_version`` its version; ``cuda_checkpoint``,
    the fallback utility's name or path (None: no fallback) and ``run`` how to run it;
    ``proc``, where /proc is.
    """

    def __init__(
        self,
        *,
        driver: Any = None,
        driver_bindings_version: str | None = None,
        cuda_checkpoint: str | None = DEFAULT_BINARY,
        run: Runner = run_subprocess,
        proc: Path = Path("/proc"),
    ) -> None:
        self._driver = driver
        self._driver_version_text = driver_bindings_version
        self._binary_name = cuda_checkpoint
        self._run = run
        self._proc = proc
        self._backend: Backend | None = None
        self._unavailable: GpuUnavailable | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-cuda")
        self._closed = False
        self._close_lock = threading.Lock()

    # ---- the GpuCheckpointer port ------------------------------------------------------------

    def uses_cuda(self, pid: int) -> bool:
        """Whether ``pid`` has a CUDA context (see the module doc for the no-driver cases)."""
        return self._on_worker(lambda: self._uses_cuda(pid))

    def state(self, pid: int) -> CudaState:
        return self._on_worker(lambda: self._call("cuCheckpointProcessGetState", pid).state(pid))

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED, waiting up to ``timeout_ms`` (0: no limit)."""
        self._on_worker(lambda: self._call("cuCheckpointProcessLock", pid).lock(pid, timeout_ms))

    def checkpoint(self, pid: int) -> None:
        self._on_worker(
            lambda: self._call("cuCheckpointProcessCheckpoint", pid).checkpoint(pid)
        )

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED. A ``gpu_map`` whose every pair is old == new is no remap
        (and then needs no r580 driver)."""
        pairs = dict(gpu_map or {})
        remap = pairs if any(old != new for old, new in pairs.items()) else None
        self._on_worker(
            lambda: self._call("cuCheckpointProcessRestore", pid).restore(pid, remap)
        )

    def unlock(self, pid: int) -> None:
        self._on_worker(lambda: self._call("cuCheckpointProcessUnlock", pid).unlock(pid))

    # ---- beyond the port ---------------------------------------------------------------------

    def describe(self) -> str:
        """Which backend serves the calls, or why none can."""
        def what() -> str:
            try:
                return self._ensure().describe()
            except GpuUnavailable as exc:
                return f"unavailable: {exc.message}"

        return self._on_worker(what)

    def close(self) -> None:
        """End the worker thread (after the call in progress). Later calls raise
        ``GpuUnavailable``. Idempotent."""
        with self._close_lock:
            self._closed = True
        self._executor.shutdown(wait=True)

    # ---- internals ---------------------------------------------------------------------------

    def _on_worker(self, work: Callable[[], T]) -> T:
        with self._close_lock:
            if self._closed:
                raise GpuUnavailable("the CUDA checkpointer is closed (daemon stopping)")
            future = self._executor.submit(work)
        return future.result()

    def _uses_cuda(self, pid: int) -> bool:
        group = tgid(pid, self._proc)
        if group is None:
            return False
        if group != pid:
            raise self._thread_error("cuCheckpointProcessGetRestoreThreadId", pid, group)
        try:
            backend = self._ensure()
        except GpuUnavailable as exc:
            if maps_nvidia_devices(pid, self._proc):
                raise GpuUnavailable(
                    f"pid {pid} uses an NVIDIA GPU but cannot be checkpointed: {exc.message}",
                    hint=exc.hint,
                    pid=pid,
                ) from exc
            return False
        return backend.restore_tid(pid) is not None

    def _call(self, call: str, pid: int) -> Backend:
        """The backend, once ``pid`` is known to be a live process (not a thread)."""
        group = tgid(pid, self._proc)
        if group is None:
            raise GpuFailed(
                f"{call} for pid {pid} failed: no such process",
                call=call,
                code="NO_SUCH_PROCESS",
                pid=pid,
            )
        if group != pid:
            raise self._thread_error(call, pid, group)
        return self._ensure(pid)

    @staticmethod
    def _thread_error(call: str, pid: int, group: int) -> GpuFailed:
        return GpuFailed(
            f"{call} for pid {pid} failed: {pid} is a thread of process {group}, not a process",
            call=call,
            code="NOT_A_PROCESS",
            hint=f"pass the process id {group}",
            pid=pid,
        )

    def _ensure(self, pid: int | None = None) -> Backend:
        """The backend, chosen at the first call (on the worker thread); else a fresh
        ``GpuUnavailable`` with the reason found then (about ``pid``)."""
        if self._backend is not None:
            return self._backend
        if self._unavailable is None:
            try:
                self._backend = self._choose()
                return self._backend
            except GpuUnavailable as exc:
                self._unavailable = exc
        reason = self._unavailable
        raise GpuUnavailable(reason.message, hint=reason.hint, pid=pid) from reason.__cause__

    def _choose(self) -> Backend:
        api, reason, final = self._bindings_backend()
        if api is not None:
            return api
        assert reason is not None
        binary = None if final else self._find_binary()
        if binary is not None:
            return CudaCheckpointBinary(binary, self._run)
        raise reason

    def _bindings_backend(self) -> tuple[DriverApi | None, GpuUnavailable | None, bool]:
        """(the bindings backend, None, _) or (None, why the bindings cannot serve, whether
        the cuda-checkpoint utility could not serve either: no driver at all)."""
        cu = self._driver
        version = self._driver_version_text
        if cu is None:
            try:
                cu = importlib.import_module("cuda.bindings.driver")
            except ImportError:
                return None, GpuUnavailable(NOT_INSTALLED), False
            if version is None:
                version = bindings_version()
        version = version or ""
        try:
            status, driver_version = cu.cuDriverGetVersion()
        except RuntimeError as exc:  # no libcuda.so.1 (DynamicLibNotFoundError in 13.x)
            reason = GpuUnavailable(
                f"no usable NVIDIA driver (libcuda.so.1): {exc}",
                hint="install the NVIDIA driver (r570 or newer)",
            )
            return None, reason, True
        if status != cu.CUresult.CUDA_SUCCESS:
            name = DriverApi(cu, 0, version).error_name(status)
            return None, GpuUnavailable(f"cuDriverGetVersion failed: {name}"), True
        driver_version = int(driver_version)
        if driver_version < CHECKPOINT_API_DRIVER:
            reason = GpuUnavailable(
                f"driver CUDA {format_cuda_version(driver_version)} lacks the checkpoint API: "
                f"needs r570 / CUDA 12.8",
                hint="upgrade the NVIDIA driver to r570 or newer",
            )
            return None, reason, False
        missing = [name for name in CHECKPOINT_FUNCTIONS if not hasattr(cu, name)]
        if missing:
            parsed = parse_version(version)
            need = (
                ".".join(map(str, GPU_REMAP_BINDINGS))
                if parsed[:2] == (13, 0)
                else ".".join(map(str, CHECKPOINT_API_BINDINGS))
            )
            reason = GpuUnavailable(
                f"cuda-bindings {version or '(unknown version)'} lacks {', '.join(missing)}: "
                f"needs cuda-bindings >= {need}",
                hint=f"pip install -U 'cuda-python>={need}'",
            )
            return None, reason, False
        api = DriverApi(cu, driver_version, version)
        try:
            status = cu.cuInit(0)[0]
        except RuntimeError as exc:
            return None, GpuUnavailable(f"cuInit failed: {exc}"), True
        if status != cu.CUresult.CUDA_SUCCESS:
            return None, GpuUnavailable(f"cuInit failed: {api.error_name(status)}"), True
        return api, None, False

    def _find_binary(self) -> str | None:
        if not self._binary_name:
            return None
        if "/" in self._binary_name:
            return self._binary_name if Path(self._binary_name).is_file() else None
        return shutil.which(self._binary_name)
