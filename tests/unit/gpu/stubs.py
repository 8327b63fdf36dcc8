"""Stand-ins for ``cuda.bindings.driver`` and ``pynvml``, with the shapes of the real ones
(cuda-bindings 13.4 and nvidia-ml-py 13.x, as inspected), and a fake /proc."""

from __future__ import annotations

import ctypes
import enum
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- cuda.bindings.driver ------------------------------------------------------------------


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3
    CU_PROCESS_STATE_CHECKPOINTING = 4
    CU_PROCESS_STATE_RESTORING = 5


class CUuuid:
    """Like the bindings' ``CUuuid``: ``bytes`` is read-only, ``getPtr()`` its address."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(16)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)

    @property
    def bytes(self) -> bytes:
        return self._buf.raw


class CUcheckpointGpuPair:
    def __init__(self) -> None:
        self.oldUuid = CUuuid()
        self.newUuid = CUuuid()


class CUcheckpointRestoreArgs:
    def __init__(self) -> None:
        self.gpuPairs: list[CUcheckpointGpuPair] = []
        self.gpuPairsCount = 0


class CUcheckpointLockArgs:
    def __init__(self) -> None:
        self.timeoutMs = 0


_MOVES = {
    "cuCheckpointProcessLock": (0, 1),
    "cuCheckpointProcessCheckpoint": (1, 2),
    "cuCheckpointProcessRestore": (2, 1),
    "cuCheckpointProcessUnlock": (1, 0),
}


class StubCu:
    """A ``cuda.bindings.driver`` for tests: the checkpoint state machine over ``states``
    (pid -> CUprocessState value; a pid not there is not a CUDA process).

    ``fail[call]`` makes that call return the given CUresult; ``missing`` names functions
    that do not exist (``hasattr`` is False); ``raise_on[call]`` raises it (as the bindings
    do for a driver without the function). ``calls`` records ``(name, args, thread name)``.
    """

    CUresult = CUresult
    CUprocessState = CUprocessState
    CUuuid = CUuuid
    CUcheckpointGpuPair = CUcheckpointGpuPair
    CUcheckpointRestoreArgs = CUcheckpointRestoreArgs
    CUcheckpointLockArgs = CUcheckpointLockArgs

    def __init__(
        self,
        *,
        version: int = 13000,
        states: dict[int, int] | None = None,
        missing: tuple[str, ...] = (),
        init_result: CUresult = CUresult.CUDA_SUCCESS,
    ) -> None:
        self.version = version
        self.states = dict(states or {})
        self.missing = set(missing)
        self.init_result = init_result
        self.fail: dict[str, CUresult] = {}
        self.raise_on: dict[str, Exception] = {}
        self.calls: list[tuple[str, tuple[Any, ...], str]] = []
        self.error_name_works = True

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _record(self, name: str, *args: Any) -> CUresult | None:
        self.calls.append((name, args, threading.current_thread().name))
        if name in self.raise_on:
            raise self.raise_on[name]
        return self.fail.get(name)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def cuDriverGetVersion(self) -> tuple[CUresult, int]:
        return self._record("cuDriverGetVersion") or CUresult.CUDA_SUCCESS, self.version

    def cuInit(self, flags: int) -> tuple[CUresult]:
        self._record("cuInit", flags)
        return (self.init_result,)

    def cuGetErrorName(self, err: CUresult) -> tuple[CUresult, bytes | None]:
        if not self.error_name_works:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return CUresult.CUDA_SUCCESS, CUresult(err).name.encode()

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[CUresult, int]:
        failed = self._record("cuCheckpointProcessGetRestoreThreadId", pid)
        if failed:
            return failed, 0
        if pid not in self.states:
            return CUresult.CUDA_ERROR_INVALID_VALUE, 0
        return CUresult.CUDA_SUCCESS, pid + 1

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[CUresult, Any]:
        failed = self._record("cuCheckpointProcessGetState", pid)
        if failed:
            return failed, CUprocessState(0)
        if pid not in self.states:
            return CUresult.CUDA_ERROR_INVALID_VALUE, CUprocessState(0)
        return CUresult.CUDA_SUCCESS, CUprocessState(self.states[pid])

    def _move(self, name: str, pid: int, args: Any) -> tuple[CUresult]:
        failed = self._record(name, pid, args)
        if failed:
            return (failed,)
        if pid not in self.states:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        before, after = _MOVES[name]
        if self.states[pid] != before:
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE,)
        self.states[pid] = after
        return (CUresult.CUDA_SUCCESS,)

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[CUresult]:
        return self._move("cuCheckpointProcessLock", pid, args)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[CUresult]:
        return self._move("cuCheckpointProcessCheckpoint", pid, args)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[CUresult]:
        return self._move("cuCheckpointProcessRestore", pid, args)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[CUresult]:
        return self._move("cuCheckpointProcessUnlock", pid, args)


# ---- /proc -----------------------------------------------------------------------------------


def fake_proc(
    root: Path,
    pids: list[int],
    *,
    threads: dict[int, int] | None = None,
    nvidia: tuple[int, ...] = (),
) -> Path:
    """A /proc with ``<pid>/status`` (Tgid) for each pid, ``threads`` (tid -> its process) and
    ``<pid>/maps`` naming /dev/nvidia0 for the pids of ``nvidia``."""
    for pid, group in [*((p, p) for p in pids), *(threads or {}).items()]:
        directory = root / str(pid)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "status").write_text(f"Name:\tproc\nTgid:\t{group}\nPid:\t{pid}\n")
        maps = "7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n"
        if pid in nvidia:
            maps += "7f0000002000-7f0000003000 rw-s 00000000 00:05 456 /dev/nvidia0\n"
        (directory / "maps").write_text(maps)
    return root


# ---- pynvml ----------------------------------------------------------------------------------


class NVMLError(Exception):
    _names = {
        2: "Invalid Argument",
        3: "Not Supported",
        4: "Insufficient Permissions",
        9: "Driver Not Loaded",
        12: "NVML Shared Library Not Found",
        999: "Unknown Error",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._names.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(9)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


@dataclass
class StubDevice:
    name: str
    uuid: str
    total: int
    free: int
    capability: tuple[int, int] = (9, 0)
    bus_id: bytes | str = "00000000:65:00.0"
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    minor: int | None = None
    """``nvmlDeviceGetMinorNumber`` (None: the device's position in ``StubNvml.devices``)."""
    mig: bool | None = None
    """``nvmlDeviceGetMigMode``'s current mode (None: NotSupported, a GPU without MIG)."""


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int | None


@dataclass
class _Pci:
    busId: bytes | str


class StubNvml:
    """A ``pynvml`` for tests. ``fail[name]`` raises that NVMLError from the function."""

    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(
        self,
        devices: list[StubDevice] | None = None,
        *,
        driver: str | bytes = "580.159.03",
        cuda: int = 13000,
    ) -> None:
        self.devices = list(devices or [])
        self.driver = driver
        self.cuda = cuda
        self.fail: dict[str, Exception] = {}
        self.fail_on: dict[tuple[str, int], Exception] = {}
        """(function, device index) -> raised by that function for that device only."""
        self.inits = 0
        self.shutdowns = 0
        self.active = 0
        self.max_active = 0

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self) -> None:
        self._maybe_fail("nvmlInit")
        self.inits += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.active -= 1
        self._maybe_fail("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._maybe_fail("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._maybe_fail("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> StubDevice:
        self._maybe_fail("nvmlDeviceGetHandleByIndex")
        return self.devices[index]

    def nvmlDeviceGetName(self, h: StubDevice) -> str:
        self._maybe_fail("nvmlDeviceGetName")
        return h.name

    def nvmlDeviceGetUUID(self, h: StubDevice) -> str:
        self._maybe_fail("nvmlDeviceGetUUID")
        return h.uuid

    def _device_fails(self, name: str, h: StubDevice) -> None:
        error = self.fail_on.get((name, self.devices.index(h)))
        if error is not None:
            raise error

    def nvmlDeviceGetMemoryInfo(self, h: StubDevice) -> _Memory:
        self._maybe_fail("nvmlDeviceGetMemoryInfo")
        self._device_fails("nvmlDeviceGetMemoryInfo", h)
        return _Memory(h.total, h.free, h.total - h.free)

    def nvmlDeviceGetCudaComputeCapability(self, h: StubDevice) -> tuple[int, int]:
        self._maybe_fail("nvmlDeviceGetCudaComputeCapability")
        return h.capability

    def nvmlDeviceGetPciInfo(self, h: StubDevice) -> _Pci:
        self._maybe_fail("nvmlDeviceGetPciInfo")
        return _Pci(h.bus_id)

    def nvmlDeviceGetMinorNumber(self, h: StubDevice) -> int:
        self._maybe_fail("nvmlDeviceGetMinorNumber")
        return h.minor if h.minor is not None else self.devices.index(h)

    NVML_DEVICE_MIG_ENABLE = 1

    def nvmlDeviceGetMigMode(self, h: StubDevice) -> tuple[int, int]:
        self._maybe_fail("nvmlDeviceGetMigMode")
        if h.mig is None:
            raise NVMLError_NotSupported()
        return int(h.mig), int(h.mig)

    def nvmlDeviceGetComputeRunningProcesses(self, h: StubDevice) -> list[_Process]:
        self._maybe_fail("nvmlDeviceGetComputeRunningProcesses")
        self._device_fails("nvmlDeviceGetComputeRunningProcesses", h)
        return [_Process(pid, used) for pid, used in h.processes]
