"""``NvmlInventory``: the ``GpuInventoryPort`` over NVML (``import pynvml``, package nvidia-ml-py).

pynvml is imported at the first ``inventory()``, never at module import: without it (or
without a driver) the inventory says ``available=False`` and why.

Invariants: ``inventory()`` never raises; one GPU whose NVML calls fail does not make the
inventory unavailable: it is listed with name ``UNKNOWN_GPU`` (its UUID if NVML still gives
it, else "") and the reason in ``problems``, so the node's GPU count stays right (only when
no GPU at all can be read is the inventory unavailable); each call initialises NVML and
shuts it down again (``nvmlInit`` / ``nvmlShutdown``: a driver loaded or upgraded later is
seen by the next call), and calls are serialized by a lock (NVML's init count is
process-wide). Process ids in ``uses`` are those NVML reports: host pids when the daemon
runs in the host's pid namespace.

``visible_to(pid)`` reads the process's device nodes and environment from /proc first (see
``ckptd.adapters.nvml.visibility``) and asks NVML only when something restricts it; when NVML
cannot list the GPUs then, no GPU is visible (``inventory()`` says why).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from pathlib import Path
from typing import Any

from ckptd.adapters.cuda.support import NOT_INSTALLED, format_cuda_version
from ckptd.adapters.nvml.visibility import NodeGpu, read_view, visible_uuids
from ckptd.domain import GpuInfo, GpuInventory, GpuUse
from ckptd.domain.model import UNKNOWN_GPU

log = logging.getLogger(__name__)

_REASONS = {
    "NVMLError_LibraryNotFound": "no NVIDIA driver: libnvidia-ml.so.1 not found",
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NVMLError_NoPermission": "no permission to query the NVIDIA driver",
    "NVMLError_LibRmVersionMismatch": (
        "the NVIDIA driver and its NVML library differ in version (reload the driver or reboot)"
    ),
    "NVMLError_FunctionNotFound": "the NVIDIA driver is too old for this nvidia-ml-py",
}


class _Failed(Exception):
    """Internal: an NVML call failed; ``reason`` is the inventory's message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _text(value: Any) -> str:
    """NVML strings come as str (nvidia-ml-py >= 11.5) or bytes (older, some struct fields)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


class NvmlInventory:
    """The ``GpuInventoryPort`` (see ``ckptd.core.ports``) over NVML.

    ``nvml``: an object with pynvml's API used instead of importing pynvml (for tests);
    ``proc``: where /proc is (for tests: a fake tree).
    """

    def __init__(self, nvml: Any = None, proc: Path = Path("/proc")) -> None:
        self._nvml = nvml
        self._proc = proc
        self._lock = threading.Lock()

    def inventory(self) -> GpuInventory:
        """This node's GPUs and the device memory each process holds; never raises."""
        with self._lock:
            try:
                nvml = self._module()
            except ImportError:
                return GpuInventory(False, NOT_INSTALLED)
            try:
                return self._inventory(nvml)
            except _Failed as failed:
                return GpuInventory(False, failed.reason)
            except Exception as exc:  # never raise: a broken NVML is "no GPU"
                return GpuInventory(False, f"NVML failed: {type(exc).__name__}: {exc}")

    def visible_to(self, pid: int) -> tuple[str, ...] | None:
        """The UUIDs of this node's GPUs that ``pid`` can use, None when nothing restricts it
        (the rules: ``ckptd.adapters.nvml.visibility``). Raises ``GpuUnavailable`` when
        ``pid``'s root or environment cannot be read."""
        view = read_view(pid, self._proc)
        if not view.restricted:
            return None
        seen = visible_uuids(self._node_gpus(), view)
        for note in seen.notes:
            log.info("GPUs visible to pid %d: %s", pid, note)
        return seen.uuids

    # ---- internals ---------------------------------------------------------------------------

    def _node_gpus(self) -> list[NodeGpu]:
        """Every GPU with its minor number and PCI bus id; [] when NVML cannot say."""
        with self._lock:
            try:
                nvml = self._module()
                self._call(nvml, "nvmlInit")
            except ImportError:
                return []
            except Exception as exc:  # NVML unusable: no GPU (inventory() says why)
                log.warning("cannot list GPUs for their visibility: %s", exc)
                return []
            try:
                return [
                    self._node_gpu(nvml, index)
                    for index in range(int(self._call(nvml, "nvmlDeviceGetCount")))
                ]
            except Exception as exc:
                log.warning("cannot list GPUs for their visibility: %s", exc)
                return []
            finally:
                with contextlib.suppress(Exception):
                    nvml.nvmlShutdown()

    def _node_gpu(self, nvml: Any, index: int) -> NodeGpu:
        handle = self._call(nvml, "nvmlDeviceGetHandleByIndex", index, gpu=index)
        minor = -1  # unknown: matches no device node
        bus_id = ""
        with contextlib.suppress(nvml.NVMLError):
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        with contextlib.suppress(nvml.NVMLError):
            bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        return NodeGpu(
            index=index,
            uuid=_text(self._call(nvml, "nvmlDeviceGetUUID", handle, gpu=index)),
            minor=minor,
            pci_bus_id=bus_id,
            name=_text(self._call(nvml, "nvmlDeviceGetName", handle, gpu=index)),
        )

    def _module(self) -> Any:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def _inventory(self, nvml: Any) -> GpuInventory:
        self._call(nvml, "nvmlInit")
        try:
            return self._read(nvml)
        finally:
            with contextlib.suppress(Exception):  # the answer is already made
                nvml.nvmlShutdown()

    def _read(self, nvml: Any) -> GpuInventory:
        driver = _text(self._call(nvml, "nvmlSystemGetDriverVersion"))
        cuda = int(self._call(nvml, "nvmlSystemGetCudaDriverVersion"))
        count = int(self._call(nvml, "nvmlDeviceGetCount"))
        gpus: list[GpuInfo] = []
        uses: list[GpuUse] = []
        problems: list[str] = []
        mig: list[str] = []
        for index in range(count):
            try:
                handle = self._call(nvml, "nvmlDeviceGetHandleByIndex", index, gpu=index)
                gpu = self._gpu(nvml, index, handle)
                found = self._call(
                    nvml, "nvmlDeviceGetComputeRunningProcesses", handle, gpu=index
                )
            except _Failed as failed:  # this GPU only: listed as unknown, the rest go on
                log.warning("GPU %d unknown: %s", index, failed.reason)
                problems.append(f"GPU {index} unknown: {failed.reason}")
                gpus.append(GpuInfo(index, UNKNOWN_GPU, self._uuid_or_empty(nvml, index), 0))
                continue
            gpus.append(gpu)
            if self._mig_enabled(nvml, handle):
                mig.append(gpu.uuid)
            for proc in found:
                memory = getattr(proc, "usedGpuMemory", None)
                uses.append(GpuUse(int(proc.pid), gpu.uuid, int(memory or 0)))
        if problems and len(problems) == len(gpus):  # not one GPU readable: NVML is broken
            raise _Failed(problems[0].split(": ", 1)[1])
        if not gpus:
            return GpuInventory(
                False,
                f"the NVIDIA driver {driver} sees no GPU",
                driver_version=driver,
                cuda_version=cuda,
            )
        plural = "s" if len(gpus) != 1 else ""
        unknown = f" ({len(problems)} unknown: see problems)" if problems else ""
        return GpuInventory(
            True,
            f"{len(gpus)} NVIDIA GPU{plural}{unknown}, driver {driver}, "
            f"CUDA {format_cuda_version(cuda)}",
            driver_version=driver,
            cuda_version=cuda,
            gpus=tuple(gpus),
            uses=tuple(uses),
            problems=tuple(problems),
            mig_enabled=tuple(mig),
        )

    @staticmethod
    def _mig_enabled(nvml: Any, handle: Any) -> bool:
        """Whether MIG mode is on now (``nvmlDeviceGetMigMode``'s current mode; pending
        changes need a GPU reset first). False where NVML cannot say (a GPU without MIG
        answers NotSupported; an nvidia-ml-py without the call)."""
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:
            return False
        enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        return bool(int(current) == int(enable))

    def _uuid_or_empty(self, nvml: Any, index: int) -> str:
        """The UUID of GPU ``index`` when NVML still gives it, else ""."""
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception:
            return ""

    def _gpu(self, nvml: Any, index: int, handle: Any) -> GpuInfo:
        memory = self._call(nvml, "nvmlDeviceGetMemoryInfo", handle, gpu=index)
        capability = bus_id = ""  # optional: NotSupported on some devices
        with contextlib.suppress(nvml.NVMLError):
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            capability = f"{int(major)}.{int(minor)}"
        with contextlib.suppress(nvml.NVMLError):
            bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        return GpuInfo(
            index=index,
            name=_text(self._call(nvml, "nvmlDeviceGetName", handle, gpu=index)),
            uuid=_text(self._call(nvml, "nvmlDeviceGetUUID", handle, gpu=index)),
            memory_total=int(memory.total),
            memory_free=int(memory.free),
            compute_capability=capability,
            pci_bus_id=bus_id,
        )

    @staticmethod
    def _call(nvml: Any, name: str, *args: Any, gpu: int | None = None) -> Any:
        """``nvml.<name>(*args)``; an NVMLError becomes ``_Failed`` with a clear reason
        (``gpu``, the device's index, is named in it)."""
        try:
            return getattr(nvml, name)(*args)
        except nvml.NVMLError as exc:
            where = "" if gpu is None else f" (GPU {gpu})"
            detail = f"NVML {name}{where}: {exc}"
            known = _REASONS.get(type(exc).__name__)
            raise _Failed(f"{known} ({detail})" if known else detail) from exc
