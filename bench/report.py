"""One result format for every benchmark: Markdown tables on stdout, the same as JSON.

A ``Report`` holds a benchmark's tables and its lines of text in the order they were shown.
Each table is shown as Markdown when ``show`` is called (cells formatted by their column's
``fmt``); ``to_json`` gives the numbers themselves, in the shape of
docs/performance/data/*.json that scripts/plot_benchmarks.py reads::

    {"benchmark": ..., "command": ..., "machine": ..., "units": {...},
     "columns": [...], "rows": [[...], ...],           # the first table
     "<key>": {"columns": [...], "rows": [...], "note": ...},   # every other table
     "notes": [...]}                                   # the lines of text

Invariants: a row has one cell per column (else ValueError naming the table); a cell is a
number, a string, a bool or None (``-`` in Markdown, ``null`` in JSON); JSON floats are
rounded to 4 decimals, Markdown shows what ``fmt`` shows.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

Cell = int | float | str | bool | None


@dataclass(frozen=True)
class Col:
    """A column: ``key`` in JSON, ``header`` in Markdown, cells shown by ``fmt``."""

    key: str
    header: str = ""
    fmt: str = "{}"

    @property
    def title(self) -> str:
        return self.header or self.key

    def show(self, cell: Cell) -> str:
        return "-" if cell is None else self.fmt.format(cell)


@dataclass
class Table:
    key: str
    columns: tuple[Col, ...]
    note: str = ""
    rows: list[tuple[Cell, ...]] = field(default_factory=list)

    def add(self, *cells: Cell) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.key}: a row of {len(cells)} cells for "
                             f"{len(self.columns)} columns")
        self.rows.append(cells)

    def markdown(self) -> str:
        align = ["---" if c.fmt == "{}" else "---:" for c in self.columns]
        lines = ["| " + " | ".join(c.title for c in self.columns) + " |",
                 "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(c.show(v) for c, v in zip(self.columns, row, strict=True))
                  + " |" for row in self.rows]
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "columns": [c.key for c in self.columns],
            "rows": [[_number(v) for v in row] for row in self.rows],
        }
        if self.note:
            data["note"] = self.note
        return data


def _number(cell: Cell) -> Cell:
    return round(cell, 4) if isinstance(cell, float) else cell


def machine() -> str:
    """The machine in words: kernel and CPUs."""
    return f"kernel {os.uname().release}, {os.cpu_count()} CPUs"


class Report:
    """A benchmark's result: its tables and lines, shown as they come, kept for JSON."""

    def __init__(self, benchmark: str, command: str = "") -> None:
        self.benchmark = benchmark
        self.command = command or " ".join(sys.argv)
        self.units: dict[str, str] = {}
        self.tables: list[Table] = []
        self.notes: list[str] = []

    def table(self, key: str, columns: Sequence[Col | str], note: str = "") -> Table:
        """A new table (the first one is the benchmark's main table); fill it, then ``show``."""
        if any(t.key == key for t in self.tables):
            raise ValueError(f"a second table named {key!r}")
        cols = tuple(c if isinstance(c, Col) else Col(c) for c in columns)
        table = Table(key, cols, note)
        self.tables.append(table)
        return table

    def show(self, table: Table) -> None:
        """Print ``table`` as Markdown, its note above it."""
        print(f"\n{table.note}\n" if table.note else "")
        print(table.markdown())

    def say(self, text: str) -> None:
        """A line of the result that is no table (a figure, a target met)."""
        print(text)
        self.notes.append(text.strip())

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "benchmark": self.benchmark, "command": self.command, "machine": machine(),
            "units": self.units,
        }
        if self.tables:
            data.update(self.tables[0].to_json())
        for table in self.tables[1:]:
            data[table.key] = table.to_json()
        if self.notes:
            data["notes"] = self.notes
        return data

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
