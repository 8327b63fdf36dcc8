"""Helpers of the GPU tier's checkpoint tests (``test_gpu_cycle.py``): what they need and
why it may be missing, and the workloads of ``native/gpu``.

They need everything at once: NVML seeing a GPU, root, a working CRIU (the integration tier's
check), and a CUDA workload (``fill`` built with nvcc, ``train.py`` with a Python that has
torch with CUDA). Whatever is missing skips the tests that need it, saying what.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

from ckptd.adapters.nvml import NvmlInventory
from ckptd.domain import GpuInventory
from tests.integration.conftest import tier_skip_reason
from tests.integration.support import REPO, VENV_PYTHON

GPU_DIR = REPO / "native" / "gpu"
FILL = GPU_DIR / "bin" / "fill"
TRAIN = GPU_DIR / "train.py"


@functools.cache
def gpu_inventory() -> GpuInventory:
    return NvmlInventory().inventory()


@functools.cache
def cycle_skip_reason() -> str | None:
    """Why checkpoints of CUDA processes cannot be tested here, or None."""
    inv = gpu_inventory()
    if not inv.available:
        return f"GPU checkpoint tests need a GPU that NVML sees: {inv.message}"
    if os.geteuid() != 0:
        return f"GPU checkpoint tests need root (CRIU); running as uid {os.geteuid()}"
    reason = tier_skip_reason()
    if reason is not None:
        return f"GPU checkpoint tests: {reason}"
    return None


@functools.cache
def fill_skip_reason() -> str | None:
    build = subprocess.run(
        ["make", "-C", str(GPU_DIR)], capture_output=True, text=True, timeout=600, check=False
    )
    if build.returncode != 0:
        return f"make -C native/gpu failed: {build.stderr.strip()[-500:]}"
    if not FILL.exists():
        return f"{FILL} not built: {build.stdout.strip() or 'nvcc not found'}"
    return None


@functools.cache
def torch_python() -> tuple[str | None, str]:
    """(a Python with torch and a CUDA device, "") or (None, why not). Looks at
    $CKPTD_TEST_TORCH_PYTHON, python3 on PATH, then the venv's Python."""
    candidates = [
        os.environ.get("CKPTD_TEST_TORCH_PYTHON", ""),
        shutil.which("python3") or "",
        str(VENV_PYTHON),
    ]
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    tried = []
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            rc = subprocess.run(
                [python, "-c", probe], capture_output=True, timeout=300, check=False
            ).returncode
        except (OSError, subprocess.SubprocessError):
            rc = -1
        if rc == 0:
            return python, ""
        tried.append(python)
    return None, (
        f"no Python with torch and a CUDA device (tried {', '.join(tried)}; "
        "set CKPTD_TEST_TORCH_PYTHON)"
    )


def workload_cmd(name: str, *args: object) -> list[str]:
    """The command line of ``fill`` or ``train.py`` (skipping the test if it cannot run)."""
    if name == "fill":
        reason = fill_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        return [str(FILL), *map(str, args)]
    python, reason = torch_python()
    if python is None:
        pytest.skip(reason)
    return [python, str(TRAIN), *map(str, args)]


