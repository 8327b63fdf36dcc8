"""The CUDA adapter against every supported cuda-bindings version, installed side by side
(``scripts/cuda_bindings_versions.py``: /var/cache/ckptd/cuda-bindings/<version>, wheels
cached, so a rerun needs no network), no driver needed.

Per version a subprocess with only ckptd and that version importable
(``cuda_bindings_probe.py``) builds every argument the adapter builds — lock args, restore
args with GPU pairs, the NULL the checkpoint / unlock calls take — and drives every call of
the adapter into the real functions. What each version cannot do must come out as ckptd's
own refusal, never as a foreign exception (issue #15: 13.3.0 has no
CUcheckpointRestoreArgs, and the adapter once let an AttributeError out). Skipped, with the
reason, when a version is not cached and the package index cannot be reached.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.adapters.cuda.support import SUPPORTED_BINDINGS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cuda_bindings_versions.py"
PROBE = Path(__file__).with_name("cuda_bindings_probe.py")
sys.path.insert(0, str(SCRIPT.parent))
import cuda_bindings_versions as matrix  # noqa: E402

REFUSED = matrix.EXTRA  # 13.0.1: no cuCheckpointProcessRestore
REMAP = {"13.0.3", "13.4.4", "13.5.0"}
"""Supported versions that can restore onto other GPUs (12.9.x lacks CUcheckpointGpuPair,
13.3.0 CUcheckpointRestoreArgs)."""
NO_DRIVER = "the NVIDIA driver cannot do "


@pytest.fixture(scope="session")
def bindings_cache() -> Path:
    """Every version installed (once per machine; then offline, a few seconds)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900,
        check=False,
    )
    if done.returncode == matrix.UNREACHABLE:
        pytest.skip(f"cuda-bindings versions not cached and PyPI unreachable: "
                    f"{done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    return matrix.cache_dir()


def probe(cache: Path, version: str) -> dict[str, Any]:
    target = matrix.installed(cache, version)
    assert target is not None, f"cuda-bindings {version} not installed in {cache}"
    done = subprocess.run(
        [sys.executable, "-S", str(PROBE), str(ROOT), str(target), version],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(target)), "that version, not the venv's, was used"
    return report


def no_foreign(report: dict[str, Any]) -> None:
    flat = json.dumps(report)
    assert "FOREIGN" not in flat, f"an exception escaped the adapter: {flat}"


def driver_stopped(outcome: object) -> bool:
    """The call reached the real function with ckptd's arguments and the (missing) driver
    stopped it — or, on a GPU host, the driver refused the bogus target."""
    text = str(outcome)
    return text.startswith(f"GpuUnavailable: {NO_DRIVER}") or (
        text.startswith("GpuFailed:") and "CUDA_ERROR_" in text
    ) or outcome is False


@pytest.mark.parametrize("version", SUPPORTED_BINDINGS)
def test_every_argument_builds_in_each_supported_version(
    bindings_cache: Path, version: str
) -> None:
    report = probe(bindings_cache, version)
    no_foreign(report)
    assert report["lock_args"] == 10_000
    assert report["lock_args_max"] == 0xFFFFFFFF
    assert report["lock_args_negative"].startswith("GpuFailed:")
    assert report["describe"] == f"cuda-bindings {version}, driver CUDA 13.0"
    calls = report["calls"]
    for name in ("uses_cuda", "state", "lock", "checkpoint", "restore", "unlock"):
        assert driver_stopped(calls[name]), (name, calls[name])
    assert calls["lock_negative"].startswith("GpuFailed:")
    if version in REMAP:
        assert report["remap_refusal"] is None
        assert report["restore_args"] == {
            "count": 2,
            "pairs": [
                ["8d3f6c2a51b74e90a3d26f0c1b9e7a45", "11111111222233334444555555555555"],
                ["aaaaaaaabbbbccccddddeeeeeeeeeeee", "ffffffff000011112222333333333333"],
            ],
        }
        assert driver_stopped(calls["restore_map"]), calls["restore_map"]
    else:
        lacks = "CUcheckpointGpuPair" if version.startswith("12.") else "CUcheckpointRestoreArgs"
        assert f"(it lacks {lacks}" in report["remap_refusal"]
        for outcome in (report["restore_args"], calls["restore_map"],
                        "GpuUnavailable: " + report["remap_refusal_adapter"]):
            assert outcome.startswith("GpuUnavailable: restoring onto other GPUs needs "
                                      "cuda-bindings >= 13.0.2"), outcome


@pytest.mark.parametrize("version", REFUSED)
def test_a_version_without_the_restore_function_is_refused_clearly(
    bindings_cache: Path, version: str
) -> None:
    report = probe(bindings_cache, version)
    no_foreign(report)
    why = f"cuda-bindings {version} lacks cuCheckpointProcessRestore: needs cuda-bindings >= 13.0.2"
    assert report["describe"] == f"unavailable: {why}"
    for name in ("state", "lock", "checkpoint", "restore", "restore_map", "unlock"):
        assert report["calls"][name] == f"GpuUnavailable: {why}", name
    assert report["calls"]["uses_cuda"] is False, "no backend, no /dev/nvidia*: CPU only"
