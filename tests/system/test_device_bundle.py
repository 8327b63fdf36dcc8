"""scripts/device-bundle.sh: .device/, what the GPU machine lacks (issue 22, point 1).

The GPU machine has Python 3.12 with torch, grpcio, protobuf, ... but no registry, no network
and no CRIU: the bundle carries CRIU (run with its own loader and libraries) and the wheels of
ckptd's dependencies the image lacks. Runs the script (it fetches wheels once, from PyPI)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-bundle.sh"
BUNDLE = ROOT / ".device"
CRIU = Path(os.environ.get("CKPTD_CRIU", "/usr/local/sbin/criu"))
LIMIT = 48 << 20

# What the GPU machine's image already has (tests/gpu's machine: /opt/torch/.venv, Python 3.12).
# Not grpcio and protobuf: the image's grpcio is 1.84.0 (seen on the H100, 2026-11-26), older
# than the generated code (ckptd/_gen, grpc_health) accepts, so both travel in the bundle.
GPU_IMAGE = {
    "psutil", "xxhash", "prometheus-client", "cuda-bindings", "cuda-core",
    "cuda-pathfinder", "nvidia-ml-py", "numpy", "torch", "pytest", "pytest-timeout",
    "hypothesis", "pyyaml", "packaging", "typing-extensions",
}
# Beyond ckptd's runtime dependencies: what tests/integration imports (netns, TCP, two nodes).
TEST_NEEDS = {"pyroute2"}
GPU_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "os_name": "posix", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run_script() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHON": sys.executable, "CKPTD_DEVICE_DIR": str(BUNDLE)},
    )


@functools.cache
def _first_run() -> subprocess.CompletedProcess[str]:
    return _run_script()


@pytest.fixture
def bundle() -> Path:
    if os.geteuid() != 0:
        pytest.skip(f"device bundle: needs root (`criu check`); running as uid {os.geteuid()}")
    if not os.access(CRIU, os.X_OK):
        pytest.skip(f"device bundle: no CRIU at {CRIU} (scripts/install-criu.sh)")
    proc = _first_run()
    if proc.returncode != 0 and "is PyPI reachable?" in proc.stderr:
        pytest.skip(f"device bundle: PyPI cannot be reached: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return BUNDLE


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def _size(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file())


def test_bundle_is_under_48_mib(bundle: Path) -> None:
    assert 0 < _size(bundle) <= LIMIT, f"{_size(bundle) / 2**20:.1f} MiB"
    assert "MiB" in _first_run().stdout


def test_bundled_criu_runs_with_nothing_of_the_system(bundle: Path) -> None:
    launcher = bundle / "criu" / "criu"
    proc = subprocess.run([str(launcher), "--version"], env={}, capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^Version: 4\.2\.1$", proc.stdout, re.M), proc.stdout
    # Every library initialised comes from the bundle (glibc and the loader included).
    proc = subprocess.run([str(launcher), "--version"], env={"LD_DEBUG": "libs"},
                          capture_output=True, text=True, timeout=30, check=False)
    loaded = re.findall(r"calling init: (\S+)", proc.stderr)
    assert loaded, proc.stderr[-2000:]
    lib = f"{bundle}/criu/lib/"
    assert all(p.startswith(lib) for p in loaded), [p for p in loaded if not p.startswith(lib)]
    assert any(Path(p).name == "libc.so.6" for p in loaded)
    # ckptd's own patch (scripts/criu-patches/4.2.1): `criu swrk` streams a restore's images.
    proc = subprocess.run([str(launcher), "check", "--feature", "rpc_stream"], env={},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _wheel_tags_fit(name: str) -> bool:
    """A wheel the GPU machine's CPython 3.12 on x86-64 (glibc >= 2.28) installs."""
    parts = name[: -len(".whl")].split("-")
    python, abi, platform = parts[-3], parts[-2], parts[-1]
    pythons = python.split(".")
    if abi == "abi3":
        ok_python = any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pythons)
    elif abi == "none":
        ok_python = "py3" in pythons or "cp312" in pythons
    else:
        ok_python = abi == "cp312" and "cp312" in pythons
    ok_platform = platform == "any" or any(p in PLATFORMS for p in platform.split("."))
    return bool(ok_python and ok_platform)


def test_wheels_are_cp312_x86_64_and_cover_what_the_image_lacks(
    bundle: Path, tmp_path: Path
) -> None:
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    assert wheels
    bad = [w.name for w in wheels if not _wheel_tags_fit(w.name)]
    assert not bad, f"not for CPython 3.12 manylinux x86_64: {bad}"
    have = {_norm(w.name.split("-")[0]) for w in wheels}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    runtime = {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}
    lacking = (runtime | TEST_NEEDS) - {_norm(n) for n in GPU_IMAGE}
    assert lacking <= have, f"missing from .device/wheels: {sorted(lacking - have)}"
    assert not have & {_norm(n) for n in GPU_IMAGE}, "bundles what the image has"
    # --no-deps: what they require is in the image or in the bundle.
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)([^;\n]*)(;.*)?$",
                                  zf.read(meta).decode(), re.M)
        for name, _spec, marker in requires:
            if marker and not Marker(marker[1:]).evaluate(GPU_MARKERS):
                continue
            assert _norm(name) in have | {_norm(n) for n in GPU_IMAGE}, (wheel.name, name)
    # They install the way the GPU machine installs them (no index, no deps, a target).
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platform_args,
         "--target", str(tmp_path / "site"), *map(str, wheels)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for pkg in ("zstandard", "obstore", "pyroute2", "grpc_health", "grpc_reflection"):
        assert (tmp_path / "site" / pkg).is_dir(), pkg


def test_bundle_readme_says_how_the_page_path_is_built(bundle: Path) -> None:
    text = " ".join((bundle / "README").read_text().split())
    assert "builds ckptd/_pages*.so there" in text
    assert "pure-Python page path" in text
    assert "CRIU_LIBS_DIR" in text


def test_the_page_kit_builds_an_importable_pages_module(bundle: Path, tmp_path: Path) -> None:
    """What scripts/device-check.sh does on the GPU machine, with this machine's Python: the
    module built from the kit alone (its headers, its libzstd and liblz4 by rpath) loads."""
    kit = bundle / "pages"
    for name in ("include/zstd.h", "include/zstd_errors.h", "include/xxhash.h", "include/lz4.h",
                 "include/lz4frame.h", "lib/libzstd.so.1", "lib/liblz4.so.1"):
        assert (kit / name).is_file(), name
    inc = sysconfig.get_paths()["include"]
    if not (Path(inc) / "Python.h").exists():
        pytest.skip(f"no Python.h in {inc}")
    so = tmp_path / f"_pages{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        ["gcc", "-O2", "-pthread", "-shared", "-fPIC", f"-I{inc}", f"-I{kit / 'include'}",
         str(ROOT / "ckptd" / "_pages.c"), "-o", str(so), f"-L{kit / 'lib'}", "-l:libzstd.so.1",
         "-l:liblz4.so.1", f"-Wl,-rpath,{kit / 'lib'}"], check=True, capture_output=True,
        text=True)
    linked = subprocess.run(["ldd", str(so)], capture_output=True, text=True, check=True).stdout
    assert str(kit / "lib" / "libzstd.so.1") in linked, linked
    assert str(kit / "lib" / "liblz4.so.1") in linked, linked
    probe = subprocess.run([sys.executable, "-c", "import _pages; print(sorted(dir(_pages))[:3])"],
                           env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True, check=False)
    assert probe.returncode == 0, probe.stderr


def test_second_run_changes_nothing(bundle: Path) -> None:
    before = _snapshot(bundle)
    proc = _run_script()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _snapshot(bundle) == before
    for word in ("downloaded", "copied", "built", "written", "removed"):
        assert f": {word}" not in proc.stdout, proc.stdout
