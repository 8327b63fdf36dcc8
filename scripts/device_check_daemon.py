#!/usr/bin/env python3
"""``ckptd`` for ``scripts/device_check.py``: the real daemon (``ckptd.daemon.main``), with
three test hooks switched by files in the directory ``$CKPTD_CHECK_CONTROL``:

- ``pause-after-lock`` / ``pause-after-checkpoint``: once every CUDA process of a dump is
  locked (checkpointed), write ``paused-lock`` (``paused-checkpoint``) there and sleep, so
  that the check can SIGKILL the daemon at that point;
- ``identity-remap``: a CUDA restore without a GPU map passes the driver the identity map of
  every GPU of the node (``CUcheckpointRestoreArgs`` with old == new pairs), which the daemon
  never does by itself on a node of one GPU.

``$CKPTD_CHECK_FAKE_GPU=1`` (dry runs, no GPU): the daemon's GPU adapters are a ``FakeGpu``
(``ckptd.testing``) on which a process is a CUDA process when its environment holds
``CKPTD_FAKE_CUDA=<bytes of device memory>``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONTROL_ENV = "CKPTD_CHECK_CONTROL"
FAKE_ENV = "CKPTD_CHECK_FAKE_GPU"
FAKE_CUDA_VAR = b"CKPTD_FAKE_CUDA="
PAUSE_S = 3600.0


def control(name: str) -> Path | None:
    """The control file ``name`` when it exists."""
    root = os.environ.get(CONTROL_ENV)
    if not root:
        return None
    path = Path(root) / name
    return path if path.exists() else None


def pause_if_asked(step: str, cuda_pids: tuple[int, ...]) -> None:
    if not cuda_pids or control(f"pause-after-{step}") is None:
        return
    marker = Path(os.environ[CONTROL_ENV]) / f"paused-{step}"
    marker.write_text(" ".join(map(str, cuda_pids)) + "\n")
    time.sleep(PAUSE_S)  # the check SIGKILLs the daemon now


def fake_cuda_bytes(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(FAKE_CUDA_VAR):
            try:
                return int(item[len(FAKE_CUDA_VAR):])
            except ValueError:
                return None
    return None


def install_hooks() -> None:
    from ckptd.core import gpu as core_gpu

    steps: Any = core_gpu.GpuSteps
    real_lock = steps.lock
    real_checkpoint = steps.checkpoint

    def lock(self: core_gpu.GpuSteps, session: core_gpu.GpuSession) -> None:
        real_lock(self, session)
        pause_if_asked("lock", session.cuda_pids)

    def checkpoint(self: core_gpu.GpuSteps, session: core_gpu.GpuSession) -> None:
        real_checkpoint(self, session)
        pause_if_asked("checkpoint", session.cuda_pids)

    steps.lock = lock
    steps.checkpoint = checkpoint

    if os.environ.get(FAKE_ENV) == "1":
        install_fake_gpu()
    else:
        install_identity_remap()


def install_identity_remap() -> None:
    try:
        from ckptd.adapters.cuda import driver
        from ckptd.adapters.nvml import NvmlInventory
    except ImportError:
        return
    cls: Any = driver.CudaDriverCheckpointer
    real_restore = cls.restore

    def restore(self: Any, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        if gpu_map or control("identity-remap") is None:
            real_restore(self, pid, gpu_map)
            return
        pairs = {g.uuid: g.uuid for g in NvmlInventory().inventory().gpus}
        call = "cuCheckpointProcessRestore"
        self._on_worker(
            call, pid, lambda: self._call(call, pid).restore(pid, pairs), self._call_timeout_s
        )
        marker = Path(os.environ[CONTROL_ENV]) / "identity-remap-used"
        with marker.open("a") as out:
            out.write(f"{pid} {len(pairs)}\n")

    cls.restore = restore


def install_fake_gpu() -> None:
    from ckptd.daemon import wiring
    from ckptd.domain import CudaState
    from ckptd.testing import FakeGpu

    class EnvFakeGpu(FakeGpu):
        """A FakeGpu whose CUDA processes are those with ``CKPTD_FAKE_CUDA`` set."""

        def _adopt(self, pid: int) -> None:
            if pid not in self.cuda:
                size = fake_cuda_bytes(pid)
                if size is not None:
                    self.add_cuda_process(pid, size)

        def uses_cuda(self, pid: int) -> bool:
            self._adopt(pid)
            return super().uses_cuda(pid)

        def state(self, pid: int) -> CudaState:
            self._adopt(pid)
            return super().state(pid)

        def restore_thread(self, pid: int) -> int:
            super().restore_thread(pid)  # recorded like the driver's call
            return pid  # a real thread (the main one), which the daemon's real ThreadHold
            # leaves free while it holds the others, as the driver's restore thread would be

        def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
            if not gpu_map and control("identity-remap") is not None:
                gpu_map = {g.uuid: g.uuid for g in self.gpus}
                marker = Path(os.environ[CONTROL_ENV]) / "identity-remap-used"
                with marker.open("a") as out:
                    out.write(f"{pid} {len(gpu_map)}\n")
            super().restore(pid, gpu_map)

    fake = EnvFakeGpu()

    def gpu_adapters(config: Any) -> tuple[Any, Any]:
        return (fake, fake) if config.gpu else (None, None)

    wiring.gpu_adapters = gpu_adapters


def main() -> int:
    install_hooks()
    from ckptd.daemon.main import main as daemon_main

    return int(daemon_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
