"""Every shell example of the README and the manual is run by a test or marked illustrative
(issue 28, point 4).

A shell example is a ``sh``/``bash``/``console``/``shell`` fence, or an unlabelled one whose
first line is a ``$`` prompt. The line before it says what it is:

- ``<!-- runs -->``: run here, by this test, each line with bash from the checkout's root
  (``.venv/bin`` first on PATH); every line must exit 0;
- ``<!-- tested: tests/...py -->``: a test runs these commands; that file must exist and
  name the page it reads them from;
- ``<!-- illustrative: why -->``: needs what this machine lacks (a cluster, a GPU, another
  node, a training script) or shows output; the reason is required.

Not checked here: the ADRs (records of what was measured and decided, their commands
illustrative by nature) and the pages other work streams write (``OTHERS``), until they
carry the markers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.docs.markdown import REPO, Block, blocks

DOCS = REPO / "docs"
OTHERS = ("performance/speed.md", "design/gpu-*.md")


def _pages() -> list[Path]:
    skipped = {p for pattern in OTHERS for p in DOCS.glob(pattern)}
    return [REPO / "README.md", *(p for p in sorted(DOCS.rglob("*.md"))
                                  if p not in skipped and "adr" not in p.relative_to(DOCS).parts)]


def _examples() -> list[Block]:
    return [b for page in _pages() for b in blocks(page) if b.is_shell]


def test_every_shell_example_is_run_by_a_test_or_marked_illustrative() -> None:
    problems = []
    for b in _examples():
        page = str(b.path.relative_to(REPO))
        if b.marker is None:
            problems.append(f"{b.where()}: no <!-- runs | tested: TEST | illustrative: WHY -->")
        elif b.marker == "illustrative" and not b.reason:
            problems.append(f"{b.where()}: illustrative, but says not why")
        elif b.marker == "tested":
            test = REPO / b.reason
            if not b.reason.startswith("tests/") or not test.is_file():
                problems.append(f"{b.where()}: tested by {b.reason!r}, which is no test file")
            elif page not in test.read_text():
                problems.append(f"{b.where()}: {b.reason} does not read {page}")
    assert not problems, "\n".join(problems)
    assert any(b.marker == "runs" for b in _examples())


def _commands(block: Block) -> list[str]:
    out = []
    for raw in block.text.splitlines():
        line = raw.removeprefix("$ ").strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


RUNNABLE = [b for b in _examples() if b.marker == "runs"]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where() for b in RUNNABLE])
def test_the_examples_marked_runs_run_here(block: Block) -> None:
    env = {**os.environ, "PATH": f"{REPO / '.venv/bin'}:{os.environ.get('PATH', '')}",
           "NO_MKDOCS_2_WARNING": "1"}
    for command in _commands(block):
        done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False, env=env)
        assert done.returncode == 0, (
            f"{block.where()}: `{command}` exited {done.returncode}:\n"
            f"{(done.stdout + done.stderr)[-3000:]}")
