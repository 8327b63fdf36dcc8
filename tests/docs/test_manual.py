"""The manual builds strictly and cannot drift from the code (issue 28, points 2-4).

- ``mkdocs build --strict`` (mkdocs.yml: broken links, missing anchors, absolute and
  unrecognized links are warnings, so errors): exit 0 and no WARNING line;
- the generated reference (scripts/gen_docs_reference.py), the plots
  (scripts/plot_benchmarks.py) and the sequence diagrams (scripts/draw_sequences.py) are what
  their sources give now;
- independently of the generator: every ckptctl command and option, every daemon flag, every
  configuration key and every RPC is named in its reference page;
- every relative link of the README and of the manual's pages resolves, anchors included.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2, peer_pb2
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.main import build_parser as daemon_parser
from ckptd.transport.cli.main import build_parser
from tests.docs.markdown import REPO, anchors, links

sys.path.insert(0, str(REPO / "scripts"))
import draw_sequences
import gen_docs_reference
import plot_benchmarks

MKDOCS = REPO / ".venv/bin/mkdocs"
DOCS = REPO / "docs"
GENERATED = {DOCS / "adr/index.md"}
"""Pages the build generates (scripts/mkdocs_hooks.py): links to them resolve in the site."""


def test_the_manual_builds_strictly_with_no_warning(tmp_path: Path) -> None:
    if not MKDOCS.exists():
        pytest.fail("mkdocs is not in .venv: run scripts/setup.sh (it installs ckptd[docs])")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False, env=env)
    output = build.stdout + build.stderr
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{output[-6000:]}"
    assert "WARNING" not in output, output[-6000:]
    site = tmp_path / "site"
    for page in ("index.html", "reference/ckptctl.html", "reference/config.html",
                 "reference/grpc.html", "reference/errors.html", "adr/index.html",
                 "performance/index.html", "design/index.html"):
        assert (site / page).is_file(), f"{page} missing from the built manual"
    adrs = sorted(p.stem for p in (DOCS / "adr").glob("[0-9]*.md"))
    listing = (site / "adr/index.html").read_text()
    assert all(f"{a}.html" in listing for a in adrs), "an ADR is missing from adr/index"


def test_the_generated_reference_is_current() -> None:
    assert gen_docs_reference.stale() == []


def test_the_plots_and_diagrams_are_current() -> None:
    assert plot_benchmarks.main(["--check"]) == 0, "run scripts/plot_benchmarks.py"
    assert draw_sequences.main(["--check"]) == 0, "run scripts/draw_sequences.py"


def test_every_data_file_is_plotted_and_every_plot_shown() -> None:
    data = {p.name for p in (DOCS / "performance/data").glob("*.json")}
    assert data == set(plot_benchmarks.PLOTS)
    shown = (DOCS / "performance/index.md").read_text()
    for plots in plot_benchmarks.PLOTS.values():
        for image in plots:
            assert f"(img/{image})" in shown, f"{image} is drawn but not shown"
    design = (DOCS / "design/index.md").read_text()
    for recipe in draw_sequences.ACTOR:
        assert f"(img/{recipe}-sequence.svg)" in design


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
              ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append(((*prefix, name), sub))
                out += _commands(sub, (*prefix, name))
    return out


def test_every_command_flag_key_and_rpc_is_in_the_reference() -> None:
    cli = (DOCS / "reference/ckptctl.md").read_text()
    for path, sub in _commands(build_parser()):
        assert f"### ckptctl {' '.join(path)} " in cli, f"ckptctl {' '.join(path)} missing"
        section = cli.split(f"### ckptctl {' '.join(path)} ", 1)[1].split("\n### ", 1)[0]
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in section or option in cli.split("## Commands")[0], (
                        f"ckptctl {' '.join(path)} {option} missing")
    daemon = (DOCS / "reference/ckptd.md").read_text()
    for action in daemon_parser()._actions:
        for option in action.option_strings:
            assert f"`{option}" in daemon or option in ("-h", "--help"), option
    config = (DOCS / "reference/config.md").read_text()
    for f in dataclasses.fields(DaemonConfig):
        assert f"### `{f.name}`" in config, f"config key {f.name} missing"
    grpc = (DOCS / "reference/grpc.md").read_text()
    for file in (ckptd_pb2.DESCRIPTOR, peer_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for method in service.methods:
                assert f"| `{method.name}` |" in grpc, f"rpc {service.name}.{method.name}"
        for message in file.message_types_by_name.values():
            assert f"{{#{message.full_name}}}" in grpc, f"message {message.full_name}"


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in _pages():
        for line, target in links(page):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if path and not dest.exists() and dest not in GENERATED:
                broken.append(f"{page.relative_to(REPO)}:{line}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}:{line}: {target}: no such anchor")
    assert not broken, "\n".join(broken)
