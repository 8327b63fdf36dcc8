"""``NvmlInventory`` over a stubbed pynvml: what it reports, and that it never raises."""

from __future__ import annotations

import sys
import threading

import pytest

from ckptd.adapters.cuda.support import NOT_INSTALLED
from ckptd.adapters.nvml import NvmlInventory
from ckptd.domain import GpuInfo, GpuUse
from ckptd.domain.model import UNKNOWN_GPU

from .stubs import (
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    StubDevice,
    StubNvml,
)

UUID0 = "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45"
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"
GIB = 2**30


def two_gpus() -> StubNvml:
    return StubNvml(
        [
            StubDevice(
                "NVIDIA H100 80GB HBM3", UUID0, 80 * GIB, 70 * GIB,
                bus_id=b"00000000:65:00.0", processes=[(1234, 8 * GIB), (1300, None)],
            ),
            StubDevice("NVIDIA H100 80GB HBM3", UUID1, 80 * GIB, 80 * GIB, capability=(9, 0),
                       bus_id="00000000:75:00.0"),
        ],
        driver=b"580.159.03",
        cuda=13000,
    )


def test_gpus_and_uses() -> None:
    nvml = two_gpus()
    inv = NvmlInventory(nvml).inventory()
    assert inv.available
    assert inv.message == "2 NVIDIA GPUs, driver 580.159.03, CUDA 13.0"
    assert inv.driver_version == "580.159.03"
    assert inv.cuda_version == 13000
    assert inv.gpus == (
        GpuInfo(0, "NVIDIA H100 80GB HBM3", UUID0, 80 * GIB, 70 * GIB, "9.0", "00000000:65:00.0"),
        GpuInfo(1, "NVIDIA H100 80GB HBM3", UUID1, 80 * GIB, 80 * GIB, "9.0", "00000000:75:00.0"),
    )
    assert inv.uses == (GpuUse(1234, UUID0, 8 * GIB), GpuUse(1300, UUID0, 0))
    assert set(inv.by_uuid()) == {UUID0, UUID1}
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_each_call_inits_and_shuts_down() -> None:
    nvml = two_gpus()
    inventory = NvmlInventory(nvml)
    for _ in range(3):
        assert inventory.inventory().available
    assert (nvml.inits, nvml.shutdowns, nvml.active) == (3, 3, 0)


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    inv = NvmlInventory().inventory()
    assert not inv.available
    assert inv.message == "GPU support not installed (pip install 'ckptd[gpu]')"
    assert inv.message == NOT_INSTALLED


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (NVMLError_LibraryNotFound(), "no NVIDIA driver: libnvidia-ml.so.1 not found"),
        (NVMLError_DriverNotLoaded(), "the NVIDIA driver is not loaded"),
        (NVMLError(999), "NVML nvmlInit: Unknown Error"),
    ],
)
def test_init_failures(error: Exception, words: str) -> None:
    nvml = two_gpus()
    nvml.fail["nvmlInit"] = error
    inv = NvmlInventory(nvml).inventory()
    assert not inv.available
    assert words in inv.message
    assert inv.gpus == () and inv.uses == ()
    assert nvml.shutdowns == 0, "no shutdown after a failed init"


def test_failure_while_reading_still_shuts_down() -> None:
    nvml = two_gpus()
    nvml.fail["nvmlDeviceGetComputeRunningProcesses"] = NVMLError(999)
    inv = NvmlInventory(nvml).inventory()
    assert not inv.available
    assert inv.message == "NVML nvmlDeviceGetComputeRunningProcesses (GPU 0): Unknown Error"
    assert nvml.shutdowns == 1


@pytest.mark.parametrize(
    "call", ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"]
)
def test_one_failing_gpu_is_unknown_not_the_whole_inventory(call: str) -> None:
    """Issue #15: GPU 1's call fails; GPU 0 is still reported, GPU 1 listed as unknown (so
    the node's GPU count stays right for a restore's whole-node map)."""
    nvml = two_gpus()
    nvml.fail_on[(call, 1)] = NVMLError(999)
    inv = NvmlInventory(nvml).inventory()
    assert inv.available
    assert inv.gpus[0].uuid == UUID0 and inv.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert inv.gpus[1] == GpuInfo(1, UNKNOWN_GPU, UUID1, 0)
    assert inv.problems == (f"GPU 1 unknown: NVML {call} (GPU 1): Unknown Error",)
    assert "1 unknown" in inv.message
    assert {u.pid for u in inv.uses} == {1234, 1300}
    assert nvml.shutdowns == 1


def test_optional_facts_may_be_unsupported() -> None:
    nvml = two_gpus()
    nvml.fail["nvmlDeviceGetCudaComputeCapability"] = NVMLError_NotSupported()
    nvml.fail["nvmlDeviceGetPciInfo"] = NVMLError_NotSupported()
    inv = NvmlInventory(nvml).inventory()
    assert inv.available
    assert {(g.compute_capability, g.pci_bus_id) for g in inv.gpus} == {("", "")}


def test_no_gpu() -> None:
    inv = NvmlInventory(StubNvml([], driver="570.86.10", cuda=12080)).inventory()
    assert not inv.available
    assert inv.message == "the NVIDIA driver 570.86.10 sees no GPU"
    assert (inv.driver_version, inv.cuda_version) == ("570.86.10", 12080)


def test_never_raises_even_on_surprises() -> None:
    nvml = two_gpus()
    nvml.fail["nvmlDeviceGetName"] = ValueError("surprise")
    nvml.fail["nvmlShutdown"] = NVMLError(999)
    inv = NvmlInventory(nvml).inventory()
    assert not inv.available
    assert inv.message == "NVML failed: ValueError: surprise"


class SlowNvml(StubNvml):
    def nvmlDeviceGetCount(self) -> int:
        threading.Event().wait(0.01)
        return super().nvmlDeviceGetCount()


def test_concurrent_calls_do_not_overlap() -> None:
    nvml = SlowNvml(two_gpus().devices)
    inventory = NvmlInventory(nvml)
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(inventory.inventory().available))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [True] * 6
    assert nvml.max_active == 1


def test_mig_mode_is_on_the_inventory_not_on_the_gpus() -> None:
    """Issue 23, 6: a GPU in MIG mode is named in ``mig_enabled`` (GpuInfo, which records
    carry, is unchanged); a GPU without MIG (NotSupported) or with MIG off is not."""
    nvml = two_gpus()
    nvml.devices[1].mig = True
    inv = NvmlInventory(nvml).inventory()
    assert inv.mig_enabled == (UUID1,)
    assert inv.gpus[1] == GpuInfo(
        1, "NVIDIA H100 80GB HBM3", UUID1, 80 * GIB, 80 * GIB, "9.0", "00000000:75:00.0"
    )
    nvml.devices[1].mig = False
    assert NvmlInventory(nvml).inventory().mig_enabled == ()
    nvml.fail["nvmlDeviceGetMigMode"] = NVMLError("Function Not Found")
    nvml.devices[1].mig = True
    assert NvmlInventory(nvml).inventory().available
    assert NvmlInventory(nvml).inventory().mig_enabled == ()
