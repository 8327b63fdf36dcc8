"""Shell scripts under ``set -o pipefail`` never end a pipeline with a reader that stops early.

``head``, ``grep -q``/``grep -m``, ``sed ...q`` and ``awk '{...; exit}'`` may close the pipe
before the writer is done; the writer then dies of SIGPIPE and, under pipefail, the whole
pipeline fails with 141 -- or an ``if``/``||`` silently takes the wrong branch. Whether it
happens depends on output size and timing, so it shows up on one machine and not another
(CI failed so: ``ldconfig -p | awk '... exit'`` in scripts/device-bundle.sh). A reader fed by
a here-string or a file is fine; only a ``|`` feeding it counts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p
    for pattern in ("scripts/*.sh", "deploy/**/*.sh", "deploy/**/*.sbatch", ".ci/run")
    for p in ROOT.glob(pattern)
    if "set -euo pipefail" in p.read_text() or "set -o pipefail" in p.read_text()
)

# A pipe (not ||) followed by a reader that may exit before its input ends.
EARLY_EXIT = re.compile(
    r"(?<!\|)\|(?!\|)\s*(head\b|grep\s+(-\w*[qm]|--quiet|--max-count)|sed\b[^|]*;\s*q\b|awk\b[^|]*\bexit\b)"
)


def _pipeline_lines(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines()
    joined: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if joined and joined[-1][1].rstrip().endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1].rstrip()[:-1] + " " + code.strip())
        elif joined and code.lstrip().startswith("|") and not code.lstrip().startswith("||"):
            joined[-1] = (joined[-1][0], joined[-1][1] + " " + code.strip())
        else:
            joined.append((number, code))
    return joined


def test_there_are_pipefail_scripts_to_check() -> None:
    assert any(p.name == "device-bundle.sh" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reader_stops_early_in_a_pipefail_pipeline(script: Path) -> None:
    # dpkg-query -W for one package prints one short line before grep reads it: exempt.
    offending = [
        f"{script.relative_to(ROOT)}:{number}: {code.strip()}"
        for number, code in _pipeline_lines(script)
        if EARLY_EXIT.search(code) and "dpkg-query -W" not in code
    ]
    assert not offending, (
        "a reader that may exit early under pipefail (SIGPIPE, exit 141); make it read all its"
        " input, e.g. awk 'NR == 1' or grep ... >/dev/null:\n" + "\n".join(offending)
    )


def test_the_check_sees_the_pattern_that_failed_ci() -> None:
    bad = """zlib=$(ldconfig -p | awk '$1 == "libzstd.so.1" {print $NF; exit}')"""
    assert EARLY_EXIT.search(bad)
    assert EARLY_EXIT.search("ldd x | grep -q 'not found'")
    assert EARLY_EXIT.search("x --version | sed -n 's/a//p' | head -n1")
    assert not EARLY_EXIT.search("grep -q x <<<\"$out\" || die y")
    assert not EARLY_EXIT.search("ldconfig -p | awk '!found {print $NF; found = 1}'")
