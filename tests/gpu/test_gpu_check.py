"""GPU tier: runs only where NVML sees an NVIDIA GPU (skipped with the reason elsewhere)."""

from __future__ import annotations

import pytest

from ckptd.daemon.probe import gpu_status


def _gpu_or_skip() -> None:
    ok, message = gpu_status()
    if not ok:
        pytest.skip(f"no GPU: {message}")


@pytest.mark.gpu
def test_probe_reports_gpus() -> None:
    _gpu_or_skip()
    ok, message = gpu_status()
    assert ok
    assert "GPU" in message
