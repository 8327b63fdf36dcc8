#!/usr/bin/env python3
"""Install every supported cuda-bindings version side by side, for the contract test
(tests/contract/test_cuda_bindings_versions.py), without touching the virtual environment.

    scripts/cuda_bindings_versions.py [--cache DIR] [VERSION ...]

Each version goes to ``DIR/<version>`` (``pip install --target``), with its dependencies
(cuda-pathfinder); wheels are kept in ``DIR/wheels``, so a rerun is offline and instant (a
version whose ``DIR/<version>/.complete`` exists is not touched). ``DIR``:
``$CKPTD_CUDA_BINDINGS_CACHE``, else /var/cache/ckptd/cuda-bindings. Versions: the
arguments, else ckptd's ``SUPPORTED_BINDINGS`` plus ``EXTRA`` (refused ones the test checks).

Exit status: 0 all installed; 3 the package index could not be reached for a version not
in the cache (the last line says so: the test skips with it); 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptd.adapters.cuda.support import SUPPORTED_BINDINGS  # noqa: E402

EXTRA = ("13.0.1",)
"""Installed too: a version ckptd refuses (no cuCheckpointProcessRestore), to check it says so."""
DEFAULT_CACHE = Path("/var/cache/ckptd/cuda-bindings")
UNREACHABLE = 3
_NETWORK_WORDS = (
    "NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
    "ConnectTimeout", "Max retries exceeded", "ProxyError", "Connection refused",
    "(from versions: none)",
)
"""pip's words for an index it could not reach. cuda-bindings is on PyPI, so "from versions:
none" means no index answered; a version the index lacks (other versions listed) is a
failure, not a skip."""


def cache_dir() -> Path:
    return Path(os.environ.get("CKPTD_CUDA_BINDINGS_CACHE") or DEFAULT_CACHE)


def installed(cache: Path, version: str) -> Path | None:
    """``cache/version`` when complete, else None."""
    target = cache / version
    return target if (target / ".complete").is_file() else None


def _pip(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def install(cache: Path, version: str) -> str | None:
    """Install ``version`` into ``cache/version``; None, or why not (its first word
    ``unreachable:`` when the index could not be reached)."""
    if installed(cache, version):
        return None
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"cuda-bindings=={version}"
    local = _pip("install", "--no-index", "--find-links", str(wheels), "--target",
                 str(cache / version), "--upgrade", "--quiet", spec, timeout=300)
    if local.returncode != 0:
        fetched = _pip("download", "--only-binary=:all:", "--dest", str(wheels), spec,
                       timeout=300)
        if fetched.returncode != 0:
            text = fetched.stderr.strip().splitlines()
            last = text[-1] if text else f"pip download exited {fetched.returncode}"
            words = fetched.stderr
            kind = "unreachable" if any(w in words for w in _NETWORK_WORDS) else "failed"
            return f"{kind}: cannot download {spec}: {last}"
        local = _pip("install", "--no-index", "--find-links", str(wheels), "--target",
                     str(cache / version), "--upgrade", "--quiet", spec, timeout=300)
        if local.returncode != 0:
            return f"failed: pip install --target {cache / version} {spec}: {local.stderr}"
    (cache / version / ".complete").write_text(version + "\n")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("versions", nargs="*")
    args = parser.parse_args(argv)
    cache = args.cache or cache_dir()
    versions = args.versions or [*SUPPORTED_BINDINGS, *EXTRA]
    status = 0
    for version in versions:
        why = install(cache, version)
        if why is None:
            print(f"cuda-bindings {version}: {cache / version}")
            continue
        print(why, file=sys.stderr)
        status = UNREACHABLE if why.startswith("unreachable") and status != 1 else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
