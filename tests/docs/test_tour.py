"""The README's 30-second tour, run against a real daemon on a real job (issue 28).

The commands of README.md's tour block are run as written, with its example pid replaced by
the job's, against a daemon whose node is named as in the README (``vm``); each prints as
many lines as the README shows, and each line matches the README's with ids, numbers and
sizes free and column padding any width. docs/getting-started.md's tour runs the same
commands. Needs root and a working CRIU (skipped with the integration tier's reason).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.docs.markdown import REPO, Block, blocks
from tests.integration.support import WORKLOADS_BIN, Procs, is_alive

EXAMPLE_PID = "1246"
TOKEN = re.compile(r"ck-\d{8}T\d{6}-[0-9a-f]{6}|\d+(?:\.\d+)?|(?:KiB|MiB|GiB|B)\b| {2,}")


def _tour(page: str) -> Block:
    (block,) = [b for b in blocks(REPO / page)
                if b.marker == "tested" and b.reason == "tests/docs/test_tour.py"]
    return block


def _steps(block: Block) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:].split("  #")[0].strip(), []))
        elif line.strip():
            steps[-1][1].append(line)
    return steps


def _pattern(expected: str) -> re.Pattern[str]:
    out, last = [], 0
    for m in TOKEN.finditer(expected):
        out.append(re.escape(expected[last:m.start()]))
        tok = m.group(0)
        out.append(r"ck-\d{8}T\d{6}-[0-9a-f]{6}" if tok.startswith("ck-")
                   else r" {2,}" if tok.startswith(" ")
                   else r"(?:KiB|MiB|GiB|B)" if tok[0].isalpha() else r"\d+(?:\.\d+)?")
        last = m.end()
    out.append(re.escape(expected[last:]))
    return re.compile("".join(out))


def test_getting_started_runs_the_readme_tour() -> None:
    readme = [cmd for cmd, _ in _steps(_tour("README.md"))]
    started = [cmd for cmd, _ in _steps(_tour("docs/getting-started.md"))]
    assert started == readme


@pytest.mark.integration
def test_the_readme_tour_runs_as_shown(start_daemon: Callable[..., Any], procs: Procs,
                                       workloads: Path, tmp_path: Path) -> None:
    del workloads
    daemon = start_daemon(config={"node": "vm"})
    mark = f"--interval-ms 100 --mem-mib 64 --steps 60{os.getpid() % 97}"
    subprocess.run(["setsid", "sh", "-c", f"exec {WORKLOADS_BIN}/counter {mark} "
                    f"> {tmp_path}/job.out 2>&1 < /dev/null &"], check=True, timeout=30)
    pid = ""
    for _ in range(50):
        found = subprocess.run(["pgrep", "-n", "-f", f"bin/counter {mark}"],
                               capture_output=True, text=True, check=False)
        if found.stdout.strip():
            pid = found.stdout.strip()
            break
        time.sleep(0.1)
    assert pid, "the tour's job did not start"
    procs.add(int(pid))
    time.sleep(1)
    env = {**os.environ, "CKPTD_SOCKET": str(daemon.socket),
           "PATH": f"{REPO / '.venv/bin'}:{os.environ.get('PATH', '')}"}
    for written, expected in _steps(_tour("README.md")):
        command = written.replace(EXAMPLE_PID, pid)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=120, check=False, env=env)
        assert done.returncode == 0, f"`{command}` exited {done.returncode}: {done.stderr}"
        lines = done.stdout.splitlines()
        assert len(lines) == len(expected), f"`{command}` printed:\n{done.stdout}"
        for want, got in zip(expected, lines, strict=True):
            assert _pattern(want.replace(EXAMPLE_PID, pid)).fullmatch(got), (
                f"`{command}`:\n README: {want}\n printed: {got}")
        time.sleep(0.5)
    procs.add(int(pid))
    assert is_alive(int(pid)), "the restored job is not running"
