"""Self-tests for the deterministic C/R workloads in native/workloads.

No root or CRIU needed: these only check that every workload is deterministic,
prints the exact line format, and that shorter runs are prefixes of longer
ones (the property C/R tests rely on).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WL_DIR = ROOT / "native" / "workloads"
BIN = WL_DIR / "bin"
PYLOOP = WL_DIR / "pyloop.py"

STEP_RE = re.compile(r"step ([1-9][0-9]*) ([0-9a-f]{16})")
DONE_RE = re.compile(r"done ([0-9a-f]{16})")
PY_STEP_RE = re.compile(r"step ([1-9][0-9]*) (\S+)")

RUN_TIMEOUT = 30

# name -> function(dir) -> argv (dir is a fresh, empty per-run directory)
Argv = Callable[[Path], list[str]]
CASES: dict[str, Argv] = {
    "counter": lambda d: [str(BIN / "counter")],
    "counter-mem": lambda d: [str(BIN / "counter"), "--mem-mib", "4"],
    "counter-fork": lambda d: [str(BIN / "counter"), "--mem-mib", "4", "--fork-readers"],
    "counter-drop": lambda d: [str(BIN / "counter"), "--mem-mib", "4", "--drop-page"],
    "threads": lambda d: [str(BIN / "threads")],
    "threads-1": lambda d: [str(BIN / "threads"), "--threads", "1"],
    "tree": lambda d: [str(BIN / "tree")],
    "tree-3": lambda d: [str(BIN / "tree"), "--children", "3"],
    "resources": lambda d: [str(BIN / "resources"), "--dir", str(d)],
    "bigmem": lambda d: [str(BIN / "bigmem"), "--mib", "8"],
    "bigmem-rewrite": lambda d: [str(BIN / "bigmem"), "--mib", "8", "--rewrite-pct", "10"],
    "pyloop": lambda d: [sys.executable, str(PYLOOP)],
}
PROGRAMS = {
    "counter": [str(BIN / "counter")],
    "threads": [str(BIN / "threads")],
    "tree": [str(BIN / "tree")],
    "resources": [str(BIN / "resources")],
    "bigmem": [str(BIN / "bigmem")],
    "pyloop": [sys.executable, str(PYLOOP)],
}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    missing = [tool for tool in ("make", "gcc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"cannot build native/workloads: {', '.join(missing)} not installed")
    proc = subprocess.run(
        ["make", "-C", str(WL_DIR)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"make failed:\n{proc.stdout}\n{proc.stderr}"


class Runner:
    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self._n = 0

    def fresh_dir(self) -> Path:
        self._n += 1
        d = self._tmp / f"run{self._n}"
        d.mkdir()
        return d

    def run(self, argv: Argv, *extra: str) -> list[str]:
        d = self.fresh_dir()
        proc = subprocess.run(
            [*argv(d), *extra],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            cwd=d,
        )
        assert proc.returncode == 0, f"rc={proc.returncode}\nstderr:\n{proc.stderr}"
        assert proc.stdout.endswith("\n")
        return proc.stdout.split("\n")[:-1]


@pytest.fixture
def runner(tmp_path: Path) -> Runner:
    return Runner(tmp_path)


def check_format(name: str, lines: list[str], steps: int) -> None:
    step_re = PY_STEP_RE if name == "pyloop" else STEP_RE
    assert len(lines) == steps + 1, lines
    for i, line in enumerate(lines[:-1], start=1):
        m = step_re.fullmatch(line)
        assert m, f"bad step line {line!r}"
        assert int(m.group(1)) == i
        if name == "pyloop":
            # loss printed with 17 significant digits: exact round trip
            assert format(float(m.group(2)), ".17g") == m.group(2)
    assert DONE_RE.fullmatch(lines[-1]), f"bad done line {lines[-1]!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_deterministic_format_and_prefix(runner: Runner, name: str) -> None:
    argv = CASES[name]
    a = runner.run(argv, "--steps", "20", "--interval-ms", "1")
    b = runner.run(argv, "--steps", "20", "--interval-ms", "1")
    c = runner.run(argv, "--steps", "10", "--interval-ms", "1")

    check_format(name, a, 20)
    check_format(name, c, 10)
    assert a == b, "two identical runs differ"
    assert c[:10] == a[:10], "--steps 10 is not a prefix of --steps 20"
    assert c[10] != a[20], "done line should depend on the final state"
    # The checksum must actually track the evolving state.
    values = [line.split()[2] for line in a[:-1]]
    assert len(set(values)) == len(values)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forever_mode_is_prefix(runner: Runner, name: str) -> None:
    argv = CASES[name]
    reference = runner.run(argv, "--steps", "15", "--interval-ms", "0")
    d = runner.fresh_dir()
    proc = subprocess.Popen(
        [*argv(d), "--steps", "0", "--interval-ms", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=d,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        got = [proc.stdout.readline().rstrip("\n") for _ in range(15)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=RUN_TIMEOUT)
        assert proc.stdout is not None
        proc.stdout.close()
    assert got == reference[:15]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize(
    "bad", [["--bogus"], ["--steps"], ["--steps", "x"], ["--steps", "-1"], ["extra"]]
)
def test_bad_arguments(name: str, bad: list[str]) -> None:
    argv = PROGRAMS[name] + (["--dir", "/nonexistent"] if name == "resources" else [])
    proc = subprocess.run(
        [*argv, *bad], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "usage" in proc.stderr.lower()


def test_resources_requires_dir() -> None:
    proc = subprocess.run(
        [str(BIN / "resources"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "usage" in proc.stderr.lower()


def test_resources_files(runner: Runner) -> None:
    d = runner.fresh_dir()
    proc = subprocess.run(
        [str(BIN / "resources"), "--dir", str(d), "--steps", "7", "--interval-ms", "0"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (d / "data.bin").stat().st_size == 7 * 16
    assert (d / "mapped.bin").stat().st_size == 1 << 20


def test_bigmem_ready_file(runner: Runner) -> None:
    d = runner.fresh_dir()
    ready = d / "ready"
    proc = subprocess.run(
        [str(BIN / "bigmem"), "--mib", "4", "--steps", "1", "--ready-file", str(ready)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert ready.read_text() == "ready\n"
    check_format("bigmem", proc.stdout.split("\n")[:-1], 1)


def test_bigmem_sigusr1_rewrites(runner: Runner) -> None:
    args = ["--mib", "8", "--steps", "6", "--interval-ms", "100"]
    baseline = runner.run(lambda d: [str(BIN / "bigmem"), *args])

    d = runner.fresh_dir()
    ready = d / "ready"
    proc = subprocess.Popen(
        [str(BIN / "bigmem"), *args, "--ready-file", str(ready)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=d,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().rstrip("\n")
        assert ready.exists()
        proc.send_signal(signal.SIGUSR1)
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    lines = [first, *rest.split("\n")[:-1]]
    check_format("bigmem", lines, 6)
    assert lines[0] == baseline[0]
    assert lines[-1] != baseline[-1], "SIGUSR1 did not trigger a rewrite"


def test_make_is_incremental() -> None:
    proc = subprocess.run(
        ["make", "-q", "-C", str(WL_DIR), "all"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, "second make would rebuild something"
