"""A daemon that dies after a given step, for the crash tests of the recipes: ``dying`` wraps a
recipe's steps so that the process "ends" (``Died``, a BaseException nothing catches) right
after ``Death.after``, no undo running once dead; ``step_names`` lists the recipes' steps as
they are (a step added later is covered without a change)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from ckptd.core.dump import DumpContext
from ckptd.core.recipe import Step

from .world import make_world

Ctx = TypeVar("Ctx")


class Died(BaseException):
    """The daemon's process ends here."""


@dataclass
class Death:
    after: str
    dead: bool = False


def dying(steps: tuple[Step[Ctx], ...], death: Death) -> tuple[Step[Ctx], ...]:
    """``steps``, the process dying right after ``death.after``; no undo runs once dead."""

    def wrap(step: Step[Ctx]) -> Step[Ctx]:
        def do(ctx: Ctx) -> None:
            step.do(ctx)
            if step.name == death.after:
                death.dead = True
                if isinstance(ctx, DumpContext):
                    ctx.criu = None  # its `finally` must not tell CRIU anything either
                raise Died(step.name)

        undo = step.undo

        def undo_alive(ctx: Ctx) -> None:
            if undo is not None and not death.dead:
                undo(ctx)

        return replace(step, do=do, undo=undo_alive)

    return tuple(wrap(s) for s in steps)


def step_names() -> tuple[list[str], list[str]]:
    """The recipes' steps as they are (a step added later is covered without a change)."""
    with tempfile.TemporaryDirectory() as tmp:
        w = make_world(Path(tmp))
        return [s.name for s in w.dump_recipe.steps], [s.name for s in w.restore_recipe.steps]
