"""What the documentation tests read from markdown: fenced blocks with the marker comment
before them, links, and the anchors a heading gets (GitHub's rule for README.md, MkDocs'
``toc`` rule and ``{#id}`` attributes for the manual).

Invariant: a fenced block is found only at the start of a line (indented ones included, as
inside list items), and text inside fences is never read as a link or a heading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGS = {"sh", "bash", "console", "shell"}
MARKER = re.compile(r"^\s*<!--\s*(runs|illustrative|tested)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    marker: str | None
    """``runs``, ``illustrative`` or ``tested`` (from ``<!-- ... -->`` on the line before)."""
    reason: str

    @property
    def is_shell(self) -> bool:
        """A shell example: a sh/bash/console fence, or an unlabelled one starting `$ `."""
        if self.lang in SHELL_LANGS:
            return True
        first = next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")
        return not self.lang and first.startswith("$ ")

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                         for ln in lines[i + 1:j])
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARKER.match(prev)
        out.append(Block(path, i + 1, lang, body, mark.group(1) if mark else None,
                         (mark.group(2) or "") if mark else ""))
        i = j + 1
    return out


def prose(path: Path) -> str:
    """The file's text with fenced blocks blanked out (line numbers kept)."""
    out, fence = [], ""
    for ln in path.read_text().splitlines():
        m = re.match(r"^\s*(```+)", ln)
        if m and (not fence or m.group(1).startswith(fence)):
            fence = "" if fence else m.group(1)
            out.append("")
            continue
        out.append("" if fence else ln)
    return "\n".join(out)


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline markdown link and image outside fences and code."""
    found = []
    for n, line in enumerate(prose(path).splitlines(), start=1):
        text = re.sub(r"`[^`]*`", "", line)
        found += [(n, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    return found


def github_slug(heading: str) -> str:
    text = re.sub(r"\{#[^}]*\}\s*$", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors a link into ``path`` may name: each heading's GitHub slug, its MkDocs slug
    and its explicit ``{#id}``."""
    found: set[str] = set()
    for ln in prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", ln)
        if not m:
            continue
        heading = m.group(1)
        explicit = re.search(r"\{#([^}]+)\}\s*$", heading)
        if explicit:
            found.add(explicit.group(1))
        found.add(github_slug(heading))
        plain = re.sub(r"\{#[^}]*\}\s*$", "", heading).replace("`", "")
        found.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", plain).strip().lower()))
    return found
