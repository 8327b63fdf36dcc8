"""Run by test_cuda_bindings_versions.py as ``python -S cuda_bindings_probe.py ROOT TARGET
VERSION``: with only ckptd (ROOT) and one cuda-bindings (TARGET) importable, build every
argument the CUDA adapter builds, through the adapter itself, and print what happened as
JSON. No driver is needed: the driver's version and cuInit are stubbed (every other name is
the real module's), so the adapter picks the bindings backend and each call reaches the
real function with ckptd's real arguments — where the missing libcuda.so.1 (or, on a GPU
host, the driver's refusal of a bogus target) stops it.

Every outcome is ``"ok"``, ``"<CkptdErrorClass>: <message>"`` or ``"FOREIGN <Type>: ..."``
(an exception that escaped the adapter: always a bug).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

root, target, version = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path[:0] = [target, root]

import cuda.bindings.driver as real  # noqa: E402

from ckptd.adapters.cuda import CudaDriverCheckpointer  # noqa: E402
from ckptd.adapters.cuda.bindings import DriverApi  # noqa: E402
from ckptd.errors import CkptdError  # noqa: E402

OLD = "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45"
NEW = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_OLD = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
OTHER_NEW = "gpu-FFFFFFFF-0000-1111-2222-333333333333"


class Driver:
    """The real module, but for a driver that says CUDA 13.0 and initialises."""

    def __getattr__(self, name: str) -> Any:
        return getattr(real, name)

    def cuDriverGetVersion(self) -> tuple[Any, int]:
        return real.CUresult.CUDA_SUCCESS, 13000

    def cuInit(self, flags: int) -> tuple[Any]:
        return (real.CUresult.CUDA_SUCCESS,)


def outcome(work: Any) -> Any:
    try:
        value = work()
    except CkptdError as exc:
        return f"{type(exc).__name__}: {exc.message}"
    except BaseException as exc:
        return f"FOREIGN {type(exc).__name__}: {exc}"
    return "ok" if value is None else value


def main() -> None:
    api = DriverApi(real, 13000, version)
    report: dict[str, Any] = {
        "module": str(Path(real.__file__).resolve()),
        "has": {n: hasattr(real, n) for n in (
            "CUcheckpointLockArgs", "CUcheckpointCheckpointArgs", "CUcheckpointRestoreArgs",
            "CUcheckpointUnlockArgs", "CUcheckpointGpuPair", "CUuuid",
            "cuCheckpointProcessRestore")},
    }
    report["lock_args"] = outcome(lambda: int(api.build_lock_args(10_000, 7).timeoutMs))
    report["lock_args_max"] = outcome(lambda: int(api.build_lock_args(0xFFFFFFFF, 7).timeoutMs))
    report["lock_args_negative"] = outcome(lambda: api.build_lock_args(-1, 7))

    def restore_args() -> Any:
        args = api.build_restore_args({OLD: NEW, OTHER_OLD: OTHER_NEW.upper()}, 7)
        return {
            "count": int(args.gpuPairsCount),
            "pairs": [[bytes(p.oldUuid.bytes).hex(), bytes(p.newUuid.bytes).hex()]
                      for p in args.gpuPairs],
        }

    report["restore_args"] = outcome(restore_args)
    report["remap_refusal"] = api.remap_refusal()
    # the structs ckptd passes NULL for: they exist or not, ckptd never needs them
    for name in ("CUcheckpointCheckpointArgs", "CUcheckpointUnlockArgs"):
        report[name] = outcome(lambda n=name: type(getattr(real, n)()).__name__)

    # the whole adapter, every call, with the real functions and ckptd's real arguments
    gpu = CudaDriverCheckpointer(
        driver=Driver(), driver_bindings_version=version, cuda_checkpoint=None,
        call_timeout_s=60,
    )
    pid = os.getpid()
    try:
        report["describe"] = gpu.describe()
        report["remap_refusal_adapter"] = outcome(gpu.remap_refusal)
        report["calls"] = {
            "uses_cuda": outcome(lambda: gpu.uses_cuda(pid)),
            "state": outcome(lambda: gpu.state(pid).name),
            "lock": outcome(lambda: gpu.lock(pid, 10_000)),
            "lock_negative": outcome(lambda: gpu.lock(pid, -1)),
            "checkpoint": outcome(lambda: gpu.checkpoint(pid)),
            "restore": outcome(lambda: gpu.restore(pid)),
            "restore_map": outcome(lambda: gpu.restore(pid, {OLD: NEW, OTHER_OLD: OTHER_OLD})),
            "unlock": outcome(lambda: gpu.unlock(pid)),
        }
    finally:
        gpu.close()
    print(json.dumps(report))


main()
