"""``CudaDriverCheckpointer``: the ``GpuCheckpointer`` port over the CUDA driver's checkpoint API.

Through ``from cuda.bindings import driver as cu`` (package cuda-bindings;
``pip install 'ckptd[gpu]'``), imported at first use, never at module import: ckptd runs
without it and without a driver.

Which versions need which (``cuDriverGetVersion()`` is 1000*major + 10*minor):

==============================================  ====================  ==================
what                                            driver                cuda-bindings
==============================================  ====================  ==================
lock / checkpoint / restore / unlock / state    r570, CUDA 12.8       >= 12.9.1 [#]_
restore onto other GPUs (``gpu_map``)           r580, CUDA 13.0       >= 13.0.2 [#]_
``cuda-checkpoint --action ...`` (fallback)     r570                  (none)
``cuda-checkpoint --toggle`` (fallback)         r550                  (none)
==============================================  ====================  ==================

.. [#] 12.8.x has the API but holds the GIL during driver calls: a long checkpoint would
   stall every thread of the daemon, the systemd watchdog ping included, so it is refused
   (the ``cuda-checkpoint`` fallback, a subprocess, is used instead when present).
.. [#] and ``CUcheckpointRestoreArgs``, looked for itself: 13.0.0 and 13.0.1 lack
   ``cuCheckpointProcessRestore``, 13.3.0 lacks ``CUcheckpointRestoreArgs``.

The backend is chosen at the first call: the bindings when they import, are not older than
12.9.1, have every ``cuCheckpointProcess*`` function and the driver says >= 12080; else,
when a ``cuda-checkpoint`` executable is on PATH, that (see ``ckptd.adapters.cuda.binary``);
else every call raises ``GpuUnavailable`` saying what is missing. The choice (or the reason
none works) is kept for the adapter's life: restart the daemon after installing a driver.
``remap_refusal()`` says, before anything is restored, whether that backend can restore onto
other GPUs (restore planning asks it).

Invariants:

- every driver call runs on the adapter's worker (``ckptd.adapters.cuda.worker``): never on a
  caller's (gRPC) thread; one at a time per pid, calls on different pids concurrently; each
  wait bounded from the call's start — queries by ``query_timeout_s``, a lock by its own
  timeout plus that, checkpoint / restore / unlock by ``call_timeout_s``. A call still
  queued behind another on its pid when its bound has passed since submission never reaches
  the driver (``GpuFailed`` code ``QUEUED``, saying what it was queued behind). A call past
  its bound raises ``GpuFailed`` code ``TIMEOUT`` and is left to finish on its lane (calls
  on that pid are refused with code ``BUSY`` meanwhile); its answer is kept: when a late
  lock, checkpoint, restore or unlock finishes, successful or not, that process is brought
  back to RUNNING (its caller has failed by then), logged.
  ``close`` never waits long;
- the backend is chosen once, under a lock (lanes may ask for it at the same time);
- ``cuInit(0)`` is called once, on the worker, before any checkpoint call (a restore needs
  it, or persistence mode);
- pids are host pids of processes: a thread id (which the driver would accept and apply to
  its process) is refused with ``GpuFailed`` after a look at ``Tgid`` in /proc/PID/status;
- no foreign exception leaves the adapter: a driver error becomes ``GpuFailed("<call> for
  pid <pid> failed: <CUDA_ERROR_NAME>")`` with ``call``, ``code`` and ``pid``; a missing
  function or type, or arguments the bindings refuse, ``GpuUnavailable``; anything else
  ``GpuFailed`` code ``INTERNAL`` — each with the original as ``__cause__``.

``uses_cuda`` is False for a process without a CUDA context (the probe's "no context"
errors, and CUDA_ERROR_NOT_INITIALIZED: a process that never initialised CUDA itself, a
forked child of a CUDA process included; any other error is raised), and when no backend
works and the process has no ``/dev/nvidia*`` mapped (no driver, nothing to checkpoint). A
process that does map NVIDIA devices while no backend works raises ``GpuUnavailable``: it
cannot be checkpointed and must not be mistaken for a CPU-only one.
"""

from __future__ import annotations

import importlib
import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ckptd.adapters.cuda.binary import (
    QUERY_TIMEOUT_S,
    CudaCheckpointBinary,
    Runner,
    run_subprocess,
)
from ckptd.adapters.cuda.bindings import (
    CHECKPOINT_FUNCTIONS,
    DriverApi,
    bindings_version,
    driver_refusal,
    gil_refusal,
)
from ckptd.adapters.cuda.support import (
    BINDINGS_12_PIP,
    CHECKPOINT_API_DRIVER,
    GIL_RELEASE_BINDINGS,
    GPU_REMAP_BINDINGS,
    NOT_INSTALLED,
    format_cuda_version,
    maps_nvidia_devices,
    parse_version,
    tgid,
)
from ckptd.adapters.cuda.worker import CallWorker
from ckptd.domain import CudaState
from ckptd.errors import CkptdError, GpuFailed, GpuUnavailable

__all__ = ["CHECKPOINT_FUNCTIONS", "CudaDriverCheckpointer", "DriverApi", "bindings_version"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BINARY = "cuda-checkpoint"
DEFAULT_CALL_TIMEOUT_S = 900.0
"""Bound of a checkpoint / restore / unlock call (device memory of a big model moves at some
GB/s: minutes at most)."""


class Backend(Protocol):
    """What ``CudaDriverCheckpointer`` needs of a way to reach the driver."""

    def describe(self) -> str: ...

    def restore_tid(self, pid: int) -> int | None:
        """The process's CUDA restore thread; None when it has no CUDA context. Raises when
        the driver cannot tell."""
        ...

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_map: dict[str, str] | None) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def remap_refusal(self) -> str | None:
        """Why this backend cannot restore onto other GPUs (None: it can)."""
        ...


class CudaDriverCheckpointer:
    """The ``GpuCheckpointer`` port (see ``ckptd.core.ports``) over the CUDA driver.

    See the module doc for versions, backends and invariants. Parameters (all for tests or
    unusual set-ups): ``driver``, an object with the API of ``cuda.bindings.driver`` used
    instead of importing it, and ``driver_bindings_version`` its version; ``cuda_checkpoint``,
    the fallback utility's name or path (None: no fallback) and ``run`` how to run it;
    ``proc``, where /proc is; ``call_timeout_s`` / ``query_timeout_s``, the bounds of the
    waits (module doc).
    """

    def __init__(
        self,
        *,
        driver: Any = None,
        driver_bindings_version: str | None = None,
        cuda_checkpoint: str | None = DEFAULT_BINARY,
        run: Runner = run_subprocess,
        proc: Path = Path("/proc"),
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        query_timeout_s: float = QUERY_TIMEOUT_S,
    ) -> None:
        if call_timeout_s <= 0 or query_timeout_s <= 0:
            raise ValueError("CUDA call timeouts must be positive")
        self._driver = driver
        self._driver_version_text = driver_bindings_version
        self._binary_name = cuda_checkpoint
        self._run = run
        self._proc = proc
        self._call_timeout_s = call_timeout_s
        self._query_timeout_s = query_timeout_s
        self._backend: Backend | None = None
        self._unavailable: GpuUnavailable | None = None
        self._choosing = threading.Lock()
        self._worker = CallWorker("ckptd-cuda")

    # ---- the GpuCheckpointer port ------------------------------------------------------------

    def uses_cuda(self, pid: int) -> bool:
        """Whether ``pid`` has a CUDA context (see the module doc for the no-driver cases)."""
        call = "cuCheckpointProcessGetRestoreThreadId"
        return self._on_worker(call, pid, lambda: self._uses_cuda(pid))

    def state(self, pid: int) -> CudaState:
        call = "cuCheckpointProcessGetState"
        return self._on_worker(call, pid, lambda: self._call(call, pid).state(pid))

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED, waiting up to ``timeout_ms`` (0: no limit in the driver; the
        wait here is bounded all the same). A negative timeout is refused."""
        call = "cuCheckpointProcessLock"
        if timeout_ms < 0:
            raise GpuFailed(
                f"{call} for pid {pid} refused: negative lock timeout {timeout_ms} ms",
                call=call, code="INVALID_TIMEOUT", pid=pid,
            )
        bound = timeout_ms / 1000 + self._query_timeout_s if timeout_ms else self._call_timeout_s
        self._on_worker(
            call, pid, lambda: self._call(call, pid).lock(pid, timeout_ms), bound,
            settle=lambda: self._settle(pid, None),
        )

    def checkpoint(self, pid: int) -> None:
        call = "cuCheckpointProcessCheckpoint"
        self._on_worker(
            call, pid, lambda: self._call(call, pid).checkpoint(pid), self._call_timeout_s,
            settle=lambda: self._settle(pid, None),
        )

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED. A ``gpu_map`` whose every pair is old == new is no remap
        (and then needs no r580 driver); else it is passed whole, identity pairs included."""
        call = "cuCheckpointProcessRestore"
        pairs = dict(gpu_map or {})
        remap = pairs if any(old != new for old, new in pairs.items()) else None
        self._on_worker(
            call, pid, lambda: self._call(call, pid).restore(pid, remap), self._call_timeout_s,
            settle=lambda: self._settle(pid, remap),
        )

    def unlock(self, pid: int) -> None:
        call = "cuCheckpointProcessUnlock"
        self._on_worker(
            call, pid, lambda: self._call(call, pid).unlock(pid), self._call_timeout_s,
            settle=lambda: self._settle(pid, None),
        )

    def restore_thread(self, pid: int) -> int:
        """The tid the driver restores and unlocks ``pid`` on (docs/adr/0019)."""
        call = "cuCheckpointProcessGetRestoreThreadId"

        def ask() -> int:
            tid = self._call(call, pid).restore_tid(pid)
            if tid is None:
                raise GpuFailed(f"{call} for pid {pid}: it has no CUDA context", call=call,
                                code="NO_CUDA", pid=pid)
            return tid

        return self._on_worker(call, pid, ask)

    def remap_refusal(self) -> str | None:
        """Why a restore onto other GPUs cannot be done here (the backend's reason, or why
        there is no backend); None: it can."""
        def ask() -> str | None:
            try:
                return self._ensure().remap_refusal()
            except GpuUnavailable as exc:
                return exc.message

        try:
            return self._on_worker("remap check", None, ask)
        except GpuFailed as exc:  # a stuck driver (TIMEOUT): a reason, never a raise (port)
            return f"the driver could not say whether it can restore onto other GPUs: {exc}"

    # ---- beyond the port ---------------------------------------------------------------------

    def describe(self) -> str:
        """Which backend serves the calls, or why none can."""
        def what() -> str:
            try:
                return self._ensure().describe()
            except GpuUnavailable as exc:
                return f"unavailable: {exc.message}"

        try:
            return self._on_worker("describe", None, what)
        except GpuFailed as exc:  # a stuck driver at start-up: said, not raised
            return f"unavailable: {exc}"

    def close(self) -> None:
        """End the worker (after the call in progress, waiting a few seconds at most). Later
        calls raise ``GpuUnavailable``. Idempotent."""
        self._worker.close()

    # ---- internals ---------------------------------------------------------------------------

    def _on_worker(
        self,
        call: str,
        pid: int | None,
        work: Callable[[], T],
        timeout_s: float | None = None,
        *,
        settle: Callable[[], None] | None = None,
    ) -> T:
        """``work()`` on the worker, bounded by ``timeout_s`` (default: the query bound),
        foreign exceptions mapped (module doc). ``settle``: for a call that moves ``pid``
        (lock, checkpoint, restore, unlock), run once it finishes after being abandoned —
        its caller has failed by then, so the process is brought back to RUNNING."""

        def guarded() -> T:
            try:
                return work()
            except CkptdError:
                raise
            except Exception as exc:
                raise _foreign(call, pid, exc) from exc

        return self._worker.run(
            guarded, timeout_s or self._query_timeout_s, call=call, pid=pid, on_late=settle
        )

    def _settle(self, pid: int, gpu_map: dict[str, str] | None) -> None:
        """After an abandoned lock / checkpoint / restore / unlock returned at last (its
        caller failed: a dump rolled back, a resume or restore reported a timeout): restore
        if CHECKPOINTED (onto ``gpu_map``, the late restore's own), unlock if LOCKED — on
        the pid's lane, directly. A late successful restore or unlock is so followed by the
        process running again, a late lock or checkpoint undone."""
        backend = self._ensure(pid)
        state = backend.state(pid)
        if state is CudaState.CHECKPOINTED:
            backend.restore(pid, gpu_map)
            state = backend.state(pid)
        if state is CudaState.LOCKED:
            backend.unlock(pid)
        log.warning("pid %d: CUDA brought back to %s after its late call", pid,
                    backend.state(pid).name)

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
        with self._choosing:  # lanes of several pids may get here at once: choose once
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
        mismatch = driver_refusal(version, driver_version)
        if mismatch is not None:
            return None, GpuUnavailable(mismatch, hint=BINDINGS_12_PIP), False
        missing = [name for name in CHECKPOINT_FUNCTIONS if not hasattr(cu, name)]
        if missing:
            parsed = parse_version(version)
            need = (
                ".".join(map(str, GPU_REMAP_BINDINGS))
                if parsed[:2] == (13, 0)
                else ".".join(map(str, GIL_RELEASE_BINDINGS))
            )
            reason = GpuUnavailable(
                f"cuda-bindings {version or '(unknown version)'} lacks {', '.join(missing)}: "
                f"needs cuda-bindings >= {need}",
                hint=f"pip install -U 'cuda-bindings>={need}'",
            )
            return None, reason, False
        too_old = gil_refusal(version)
        if too_old is not None:
            return None, GpuUnavailable(
                too_old, hint="pip install -U 'cuda-bindings>=13.4.4'"
            ), False
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


def _foreign(call: str, pid: int | None, exc: Exception) -> CkptdError:
    """A ckptd error for an exception from outside ckptd (the bindings, the utility's runner,
    a bug): ``GpuUnavailable`` when it says the bindings lack or refuse something, else
    ``GpuFailed`` code ``INTERNAL``. The caller keeps ``exc`` as the cause."""
    where = f" for pid {pid}" if pid is not None else ""
    text = f"{call}{where} failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, (AttributeError, ImportError, NotImplementedError, TypeError)):
        return GpuUnavailable(f"{text} (the installed cuda-bindings do not fit)", pid=pid)
    return GpuFailed(text, call=call, code="INTERNAL", pid=pid)
