"""Each recipe's docstring table (its "Order, and what undoes each step" block) says what its
``steps`` are: the same names in the same order, an undo where a step has one ("-", or a
parenthesized pointer to another step's undo, where it has none), and every step with a
durable record named in the "Durable undo" paragraph."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from ckptd.core import dump, migrate, restore
from ckptd.core.recipe import Step

from .world import make_world

ROW = re.compile(r"^    ([a-z][a-z-]*)\s{2,}(\S.*)$")


@dataclass(frozen=True)
class Row:
    name: str
    undo: str
    """The undo column of the row's first line."""


def table(doc: str) -> list[Row]:
    """The rows of ``doc``'s step table (rows at 4 spaces, continuation lines deeper)."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Order, and what undoes"))
    start = lines.index("", start)  # the paragraph that introduces the table ends
    rows: list[Row] = []
    for line in lines[start + 1:]:
        if rows and not line.strip():
            break
        match = ROW.match(line)
        if match:
            rows.append(Row(match.group(1), re.split(r"\s{2,}", match.group(2))[-1]))
        else:
            assert not line.strip() or line.startswith("      "), f"not a table line: {line!r}"
    return rows


def durable_paragraph(doc: str) -> str:
    start = doc.index("Durable undo")
    end = doc.find("\n\n", start)
    return doc[start:end]


def _recipes(tmp: Path) -> dict[str, tuple[str, tuple[Step[Any], ...]]]:
    world = make_world(tmp)
    nothing = cast(Any, None)
    migrate_recipe = migrate.MigrateRecipe(
        preview=nothing, dump=nothing, restore_here=nothing, pages=nothing, connector=nothing,
        clock=world.clock)
    return {
        "dump": (dump.__doc__ or "", world.dump_recipe.steps),
        "restore": (restore.__doc__ or "", world.restore_recipe.steps),
        "migrate": (migrate.__doc__ or "", migrate_recipe.steps),
    }


@pytest.mark.parametrize("recipe", ["dump", "restore", "migrate"])
def test_the_docstring_table_is_the_recipes_steps(tmp_path: Path, recipe: str) -> None:
    doc, steps = _recipes(tmp_path)[recipe]
    rows = table(doc)

    assert [r.name for r in rows] == [s.name for s in steps]
    for row, step in zip(rows, steps, strict=True):
        documented = row.undo != "-" and not row.undo.startswith("(")
        assert documented == (step.undo is not None), (
            f"{recipe} step {step.name!r}: table says undo {row.undo!r}, the step has "
            f"{'an' if step.undo else 'no'} undo")
    durable = durable_paragraph(doc)
    for step in steps:
        if step.durable is not None:
            assert re.search(rf"\b{re.escape(step.name)}\b[:,]", durable), (
                f"{recipe} step {step.name!r} has a durable record the docstring does not name")


def test_a_table_that_lies_is_caught() -> None:
    """The parser sees a missing row, and an undo column that is not there."""
    doc = ("x\n\nOrder, and what undoes each step if a later one fails:\n\n"
           "    one     does one                 undo it\n"
           "            more of one\n"
           "    two     does two                 -\n\nDurable undo: none.\n")
    assert table(doc) == [Row("one", "undo it"), Row("two", "-")]
