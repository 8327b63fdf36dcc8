"""Issue 23 (8): scripts/cuda-bindings-pin.sh (run by scripts/setup.sh) picks the
cuda-bindings major from the driver ``nvidia-smi`` reports — 12.x below 580.65.06, where 13.x
does not work — and is a no-op without a driver."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cuda-bindings-pin.sh"
PIN = ["cuda-python>=12.9.1,<13", "cuda-bindings>=12.9.1,<13"]


def pin(tmp_path: Path, smi: str | None) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "sort", "awk", "tr", "printf"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True,
                               text=True, check=False).stdout.strip()
        if found.startswith("/"):
            (bin_dir / tool).unlink(missing_ok=True)
            (bin_dir / tool).symlink_to(found)
    if smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{smi}\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}
    done = subprocess.run([str(bin_dir / "bash"), str(SCRIPT)], capture_output=True,
                          text=True, env=env, check=True)
    return done.stdout.split()


@pytest.mark.parametrize("driver", ["570.133.20", "575.57.08", "580.65.05", "560.35.03"])
def test_a_driver_below_580_65_06_gets_bindings_12(tmp_path: Path, driver: str) -> None:
    assert pin(tmp_path, f"echo {driver}") == PIN


@pytest.mark.parametrize("driver", ["580.65.06", "580.159.03", "590.44.01", "610.10"])
def test_a_driver_that_takes_bindings_13_is_left_alone(tmp_path: Path, driver: str) -> None:
    assert pin(tmp_path, f"echo {driver}; echo {driver}") == []


@pytest.mark.parametrize("smi", [None, "exit 9", "echo 'No devices were found'"])
def test_no_driver_is_a_no_op(tmp_path: Path, smi: str | None) -> None:
    assert pin(tmp_path, smi) == []
