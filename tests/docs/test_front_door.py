"""The README's two commands stay the first thing a reader sees, and keep working (issue 28).

The first fenced block of README.md is exactly ``bash scripts/demo.sh`` and ``bash
scripts/test.sh`` with their comments, preceded by nothing but the title and one sentence
(HTML comments, invisible, aside); docs/getting-started.md repeats the same block. The demo
runs here end to end (root, CRIU): set-up, a checkpoint, a restore, and the job's output
bit for bit like an uninterrupted run. test.sh is what runs this test, so it is only checked
to parse and to run pytest over tests/ (this tier included).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.markdown import REPO, blocks

TWO_COMMANDS = (
    "bash scripts/demo.sh    # set everything up (packages, CRIU, .venv), then demo checkpoint "
    "+ restore\n"
    "bash scripts/test.sh    # set everything up, then run every check and test tier (what CI "
    "runs)"
)


def _visible_lines(path: Path) -> list[str]:
    text = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
    return [ln for ln in text.splitlines() if ln.strip()]


def test_the_two_commands_are_the_first_thing_a_reader_sees() -> None:
    readme = REPO / "README.md"
    first = blocks(readme)[0]
    assert (first.lang, first.text) == ("sh", TWO_COMMANDS)
    visible = _visible_lines(readme)
    assert visible[0].startswith("# ckptd")
    assert visible[1] == "On a fresh Debian 12 machine, as root, from a checkout:"
    assert visible[2] == "```sh", "something stands between the title and the two commands"
    assert first.line <= 8, f"the two commands start at line {first.line} of README.md"
    started = blocks(REPO / "docs/getting-started.md")[0]
    assert started.text == TWO_COMMANDS


def test_both_scripts_parse_and_test_sh_runs_every_tier() -> None:
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        done = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True,
                              text=True, timeout=30, check=False)
        assert done.returncode == 0, f"{script}: {done.stderr}"
    test_sh = (REPO / "scripts/test.sh").read_text()
    assert re.search(r"^\.venv/bin/python -m pytest -ra \"\$@\"$", test_sh, re.M)
    assert "tests/docs" not in test_sh  # no tier is left out: pytest's testpaths is tests/


@pytest.mark.integration
@pytest.mark.slow
def test_the_demo_checkpoints_and_restores_bit_for_bit(tmp_path: Path) -> None:
    env = {**os.environ, "CKPTD_DEMO_DIR": str(tmp_path / "demo")}
    done = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"scripts/demo.sh exited {done.returncode}:\n{output[-4000:]}"
    assert "identical to an uninterrupted run, bit for bit" in output, output[-4000:]
