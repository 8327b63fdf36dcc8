"""Pure helpers of the CUDA adapter: GPU UUIDs, version numbers, process ids.

Nothing here touches the driver: every function is a plain computation or reads /proc, so it
is unit-tested without a GPU.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from ckptd.domain import CudaState

CHECKPOINT_API_DRIVER = 12080
"""``cuDriverGetVersion()`` of the first driver with the checkpoint API (r570 / CUDA 12.8)."""
GPU_REMAP_DRIVER = 13000
"""First driver that restores onto other GPUs (``CUcheckpointGpuPair``): r580 / CUDA 13.0."""
CHECKPOINT_API_BINDINGS = (12, 8, 0)
"""First cuda-bindings with ``cuCheckpointProcess*``."""
GIL_RELEASE_BINDINGS = (12, 9, 1)
"""First cuda-bindings that releases the GIL during driver calls (older ones would stall
every Python thread of the daemon, its systemd watchdog ping included, for a whole
checkpoint): the oldest the daemon uses."""
SUPPORTED_BINDINGS = ("12.9.4", "13.0.3", "13.3.0", "13.4.4", "13.5.0")
"""The cuda-bindings versions the contract test builds every argument struct against
(tests/contract/test_cuda_bindings_versions.py; pyproject's ``gpu`` extra and the README
say the same range). 12.9.x checkpoints on the same GPUs only; 13.3.0 too (it lacks
CUcheckpointRestoreArgs); 13.0.2 and later others can remap."""
GPU_REMAP_BINDINGS = (13, 0, 2)
"""First cuda-bindings with both ``CUcheckpointGpuPair`` and ``cuCheckpointProcessRestore``
(13.0.0 and 13.0.1 lack the latter)."""

BINDINGS_13_DRIVER = 13000
"""``cuDriverGetVersion()`` that cuda-bindings 13.x needs: r580 / CUDA 13.0 (NVIDIA's
cuda-python release notes: driver 580.65.06 or newer). On r570 / r575 (CUDA 12.8 / 12.9)
the 12.x bindings serve."""
BINDINGS_12_PIP = "pip install 'cuda-bindings>=12.9.1,<13'"
"""What fixes cuda-bindings 13.x on a driver older than r580."""

INSTALL_HINT = "pip install 'ckptd[gpu]'"
NOT_INSTALLED = f"GPU support not installed ({INSTALL_HINT})"

_UUID_PREFIX = "GPU-"
_HEX32 = re.compile(r"^[0-9a-fA-F]{32}$")


def uuid_to_bytes(text: str) -> bytes:
    """The 16 raw bytes (``CUuuid.bytes``, ``cuDeviceGetUuid``'s form) of a GPU UUID.

    Accepts NVML's form ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` and the same without the
    prefix; the bytes are the hex digits in the order written. Raises ValueError for anything
    else (MIG device UUIDs, ``MIG-...``, are not GPUs and are refused too).
    """
    body = text.strip()
    if body.startswith(_UUID_PREFIX):
        body = body[len(_UUID_PREFIX) :]
    digits = body.replace("-", "")
    if not _HEX32.fullmatch(digits) or not _dashes_ok(body):
        raise ValueError(f"not a GPU UUID: {text!r} (expected GPU-xxxxxxxx-xxxx-...)")
    return bytes.fromhex(digits)


def _dashes_ok(body: str) -> bool:
    """Either no dashes at all or the 8-4-4-4-12 grouping."""
    if "-" not in body:
        return True
    return [len(part) for part in body.split("-")] == [8, 4, 4, 4, 12]


def bytes_to_uuid(raw: bytes) -> str:
    """NVML's string form of 16 raw UUID bytes: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, not {len(raw)}")
    return _UUID_PREFIX + str(uuid.UUID(bytes=bytes(raw)))


def format_cuda_version(version: int) -> str:
    """``12080`` -> ``"12.8"`` (``cuDriverGetVersion``'s 1000*major + 10*minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numbers of a package version: ``"13.0.2.post1"`` -> ``(13, 0, 2)``;
    ``()`` when there are none."""
    numbers: list[int] = []
    for part in text.strip().split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part) or len(numbers) == 3:
            break
    return tuple(numbers)


def process_state(value: int) -> CudaState:
    """``CUprocessState`` as ``CudaState``. Raises ValueError for the custom-storage states
    (CHECKPOINTING=4, RESTORING=5, CUDA 13.4), which ckptd never asks for."""
    return CudaState(int(value))


def tgid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The thread group (process) id of ``pid`` from ``/proc/PID/status``; None when no
    process or thread has that id. A thread id gives its process's id."""
    if pid <= 0:
        return None
    try:
        text = (proc / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return None


def maps_nvidia_devices(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether ``pid`` has an NVIDIA device file mapped (``/dev/nvidia*`` in its maps): a
    process with a CUDA context always has; one whose CUDA state is checkpointed has none."""
    try:
        with (proc / str(pid) / "maps").open() as maps:
            return any("/dev/nvidia" in line for line in maps)
    except OSError:
        return False
