"""The GPU packages themselves (``ckptd[gpu]``: cuda-python, nvidia-ml-py), as installed by
scripts/setup.sh on every machine, GPU or not: every name the adapters use exists in them
(the stubs of ``stubs.py`` stand in for them elsewhere), and on a machine without an NVIDIA
driver they import, and ckptd says that the driver is missing, not that GPU support is."""

from __future__ import annotations

import ctypes
import enum
import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest

from ckptd.adapters.cuda.driver import (
    CHECKPOINT_FUNCTIONS,
    CudaDriverCheckpointer,
    DriverApi,
    bindings_version,
)
from ckptd.adapters.cuda.support import (
    CHECKPOINT_API_BINDINGS,
    GPU_REMAP_BINDINGS,
    NOT_INSTALLED,
    parse_version,
)
from ckptd.adapters.nvml import NvmlInventory
from ckptd.adapters.nvml.inventory import _REASONS
from ckptd.core.gpu import GpuSteps
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.probe import gpu_summary
from ckptd.daemon.wiring import gpu_adapters
from ckptd.domain import CudaState
from ckptd.testing import FakeClock

from . import stubs

SETUP = "scripts/setup.sh installs ckptd[gpu] (cuda-python, nvidia-ml-py) on every machine"


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} does not import ({exc}): {SETUP}")


@pytest.fixture(scope="module")
def cu() -> ModuleType:
    return _module("cuda.bindings.driver")


@pytest.fixture(scope="module")
def pynvml() -> ModuleType:
    return _module("pynvml")


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(
    _loads("libnvidia-ml.so.1") or _loads("libcuda.so.1"),
    reason="an NVIDIA driver is installed here: the no-driver answers are not what it gives",
)


# ---- cuda.bindings.driver ----------------------------------------------------------------


def test_bindings_have_the_checkpoint_api(cu: ModuleType) -> None:
    version = bindings_version()
    assert parse_version(version) >= CHECKPOINT_API_BINDINGS, (
        f"cuda-bindings {version}: the checkpoint API needs >= 12.8.0 (pyproject.toml says so)"
    )


def _remap_or_skip(cu: ModuleType) -> None:
    if parse_version(bindings_version()) < GPU_REMAP_BINDINGS:
        pytest.skip(f"cuda-bindings {bindings_version()} cannot remap GPUs (needs >= 13.0.2)")


def test_every_driver_function_the_adapter_calls_exists(cu: ModuleType) -> None:
    used = (*CHECKPOINT_FUNCTIONS, "cuInit", "cuDriverGetVersion", "cuGetErrorName")
    assert [name for name in used if not callable(getattr(cu, name, None))] == []


def test_the_types_and_fields_the_adapter_sets_exist(cu: ModuleType) -> None:
    assert cu.CUresult.CUDA_SUCCESS == 0
    assert cu.CUresult.CUDA_ERROR_ILLEGAL_STATE.name == "CUDA_ERROR_ILLEGAL_STATE"
    lock = cu.CUcheckpointLockArgs()
    lock.timeoutMs = 0xFFFFFFFF
    assert lock.timeoutMs == 0xFFFFFFFF
    _remap_or_skip(cu)
    restore = cu.CUcheckpointRestoreArgs()
    pair = cu.CUcheckpointGpuPair()
    restore.gpuPairs = [pair]
    restore.gpuPairsCount = 1
    assert restore.gpuPairsCount == 1 and len(restore.gpuPairs) == 1
    assert hasattr(pair, "oldUuid") and hasattr(pair, "newUuid")


def test_process_states_are_ckptd_states(cu: ModuleType) -> None:
    for state in CudaState:
        assert int(getattr(cu.CUprocessState, f"CU_PROCESS_STATE_{state.name}")) == state.value


def test_gpu_pairs_are_built_in_the_real_types(cu: ModuleType) -> None:
    """``cu_uuid`` fills a real ``CUuuid`` through ``getPtr()`` (its ``bytes`` is read-only);
    no driver is needed for that."""
    _remap_or_skip(cu)
    api = DriverApi(cu, 13000, bindings_version())
    pair = api.gpu_pair(
        "GPU-00112233-4455-6677-8899-aabbccddeeff", "GPU-ffeeddcc-bbaa-9988-7766-554433221100", 1
    )
    assert bytes(pair.oldUuid.bytes).hex() == "00112233445566778899aabbccddeeff"
    assert bytes(pair.newUuid.bytes).hex() == "ffeeddccbbaa99887766554433221100"
    api.check_remap(1)  # driver CUDA 13.0 and these bindings: remapping possible


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_stubs_have_only_names_of_the_real_module(cu: ModuleType, pynvml: ModuleType) -> None:
    """What the unit tests run against (``stubs.py``) is a subset of the real API."""
    fake_cu = {n for n in _public(stubs.StubCu) if n.startswith(("cu", "CU"))}
    assert sorted(n for n in fake_cu if not hasattr(cu, n)) == []
    for name in ("CUresult", "CUprocessState"):
        stub_enum: type[enum.Enum] = getattr(stubs, name)
        real = getattr(cu, name)
        assert {m.name: m.value for m in stub_enum} == {
            m.name: int(getattr(real, m.name)) for m in stub_enum
        }
    for name in ("CUcheckpointLockArgs", "CUcheckpointRestoreArgs", "CUcheckpointGpuPair"):
        if not hasattr(cu, name):
            continue  # CUcheckpointGpuPair: cuda-bindings >= 13.0 (the adapter checks)
        fields = set(vars(getattr(stubs, name)()))
        real = getattr(cu, name)()
        assert sorted(f for f in fields if not hasattr(real, f)) == [], name
    fake_nvml = {n for n in _public(stubs.StubNvml) if n.startswith(("nvml", "NVML"))}
    assert sorted(n for n in fake_nvml if not hasattr(pynvml, n)) == []


# ---- pynvml --------------------------------------------------------------------------------


def test_every_nvml_name_the_inventory_uses_exists(pynvml: ModuleType) -> None:
    used = (
        "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion",
        "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetMigMode",
    )
    assert [name for name in used if not callable(getattr(pynvml, name, None))] == []
    assert issubclass(pynvml.NVMLError, Exception)
    for error in _REASONS:  # the errors the inventory explains by name
        assert issubclass(getattr(pynvml, error), pynvml.NVMLError), error


# ---- no driver: the real reason, not "not installed" ----------------------------------------


@no_driver
def test_inventory_without_a_driver_names_nvml_and_the_driver() -> None:
    inv = NvmlInventory().inventory()
    assert not inv.available
    assert inv.message != NOT_INSTALLED
    assert "libnvidia-ml.so.1 not found" in inv.message
    assert "no NVIDIA driver" in inv.message


@no_driver
def test_checkpointer_without_a_driver_names_libcuda() -> None:
    gpu = CudaDriverCheckpointer(cuda_checkpoint=None)
    try:
        described = gpu.describe()
        assert described.startswith("unavailable: no usable NVIDIA driver (libcuda.so.1)")
        assert NOT_INSTALLED not in described
        assert gpu.uses_cuda(os.getpid()) is False, "no driver, no /dev/nvidia*: CPU only"
    finally:
        gpu.close()


@no_driver
def test_the_daemon_reports_the_missing_driver() -> None:
    """What ``ckptctl check`` and the start-up log say on a machine without a GPU."""
    checkpointer, inventory = gpu_adapters(DaemonConfig())
    assert isinstance(inventory, NvmlInventory)
    assert isinstance(checkpointer, CudaDriverCheckpointer)
    try:
        steps = GpuSteps(checkpointer, inventory, FakeClock(), 1000)
        line = gpu_summary(steps)
        assert line.startswith("no NVIDIA driver: libnvidia-ml.so.1 not found")
        assert line.endswith(": CPU checkpoints only")
        assert "not installed" not in line
    finally:
        checkpointer.close()


def test_the_start_up_line_on_a_gpu_host_names_the_gpus_and_the_backend(tmp_path: Path) -> None:
    """The same line where NVML sees GPUs (stubbed driver and NVML)."""
    nvml = stubs.StubNvml(
        [stubs.StubDevice("NVIDIA H100 80GB HBM3", "GPU-" + "1" * 8 + "-1111-1111-1111-" + "1" * 12,
                          80 * 2**30, 80 * 2**30)],
        driver="580.159.03", cuda=13000,
    )
    checkpointer = CudaDriverCheckpointer(
        driver=stubs.StubCu(version=13000), driver_bindings_version="13.4.4",
        cuda_checkpoint=None, proc=stubs.fake_proc(tmp_path / "proc", []),
    )
    try:
        line = gpu_summary(GpuSteps(checkpointer, NvmlInventory(nvml), FakeClock(), 1000))
    finally:
        checkpointer.close()
    assert line == (
        "driver 580.159.03, CUDA 13.0, 1 GPU(s); "
        "CUDA checkpoints: cuda-bindings 13.4.4, driver CUDA 13.0"
    )
    off = gpu_summary(GpuSteps(None, None, FakeClock(), 1000))
    assert off == "GPU support is not configured: CPU checkpoints only"
