"""MkDocs hooks of the manual (mkdocs.yml ``hooks:``): what keeps it from drifting.

- ``on_config``: the generated reference pages (docs/reference/, scripts/gen_docs_reference.py)
  must be current, else the build fails naming each stale page — a ckptctl command or flag, a
  daemon flag, a configuration key, an RPC or an error missing from the manual fails the build;
  nav entries of ``OPTIONAL`` pages (other work streams' files) whose file does not exist yet
  are dropped; every design note under docs/design/ not in the nav is added to "Design"; the
  "Decisions (ADRs)" entry becomes the list of docs/adr/*.md, newest last, by their titles.
- ``on_files``: ``adr/index.md`` is generated (a table of every ADR with its title), so a new
  ADR needs no edit anywhere to be listed.

Invariant: the hooks only add or drop nav entries and add one generated page; they never
change a page's text.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gen_docs_reference  # noqa: E402

OPTIONAL = {"guides/slurm.md", "gpu-hardware.md", "performance/speed.md"}
"""Pages other work streams write: listed in the nav once they exist."""
ADR_ENTRY = "adr/index.md"


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def adrs(docs: Path) -> list[tuple[str, str]]:
    """(path relative to docs/, title) of every ADR, by number."""
    return [(f"adr/{p.name}", _title(p)) for p in sorted((docs / "adr").glob("[0-9]*.md"))]


def _paths(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_paths(x) for x in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_paths(v) for v in nav.values()))
    return set()


def _filter(nav: Any, docs: Path) -> Any:
    """``nav`` without OPTIONAL entries whose file is missing (and sections left empty)."""
    if isinstance(nav, list):
        kept = [_filter(x, docs) for x in nav]
        return [x for x in kept if x is not None and x not in ({}, [])]
    if isinstance(nav, dict):
        out = {k: _filter(v, docs) for k, v in nav.items()}
        return {k: v for k, v in out.items() if v is not None and v != []} or None
    if isinstance(nav, str) and nav in OPTIONAL and not (docs / nav).is_file():
        return None
    return nav


def on_config(config: Any) -> Any:
    stale = gen_docs_reference.stale()
    if stale:
        raise PluginError("; ".join(stale))
    docs = Path(config["docs_dir"])
    nav = _filter(config["nav"], docs)
    listed = _paths(nav)
    for section in nav:
        if isinstance(section, dict) and "Design" in section:
            for note in sorted((docs / "design").glob("*.md")):
                rel = f"design/{note.name}"
                if rel not in listed:
                    section["Design"].append({_title(note): rel})
        if isinstance(section, dict) and ADR_ENTRY in section.values():
            (key,) = section
            section[key] = [{"All decisions": ADR_ENTRY},
                            *({re.sub(r"^ADR\s*", "", title): rel}
                              for rel, title in adrs(docs))]
    config["nav"] = nav
    return config


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"])
    rows = "\n".join(f"| [{rel.removeprefix('adr/')[:4]}]({Path(rel).name}) | {title} |"
                     for rel, title in adrs(docs))
    text = ("# Decisions (ADRs)\n\nEach architecture decision record says what was decided, "
            "what else was tried or measured, and why. Generated from `docs/adr/`: a new ADR "
            "is listed here by its title.\n\n| ADR | decision |\n|---|---|\n" + rows + "\n")
    files.append(File.generated(config, ADR_ENTRY, content=text))
    return files
