"""``RecipeParts``: what the dump and restore recipes, and the ``Undoer`` of their rollback
and of recovery, are built from — one bundle, wired once (``daemon.wiring``; over fakes,
``tests/unit/world``), so that every recipe sees the same ports and the same configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd.core.config import CoreConfig
from ckptd.core.gpu import GpuSteps
from ckptd.core.ports import (
    Cgroups,
    CheckpointStore,
    Clock,
    Criu,
    CriuHooks,
    JobFiles,
    Journal,
    NodeInspector,
    ProcessTable,
)
from ckptd.core.ports.asides import AsideLog
from ckptd.core.rollback import RestoreHereFn, Undoer


@dataclass(frozen=True)
class RecipeParts:
    criu: Criu
    processes: ProcessTable
    store: CheckpointStore
    journal: Journal
    clock: Clock
    config: CoreConfig
    gpu: GpuSteps
    node: NodeInspector
    hooks: CriuHooks = field(default_factory=CriuHooks)
    """Called at CRIU's notifications, after the recipe's own (tests hook in here)."""
    files: JobFiles | None = None
    """Files the job writes, captured and put back (None: not captured)."""
    cgroups: Cgroups | None = None
    """Where restored trees are placed (None: a node without cgroup v2)."""
    asides: AsideLog | None = None
    """The record of the copies restores kept aside (None: none recorded; then none is
    removed on request)."""

    def undoer(self, restore_here: RestoreHereFn | None = None) -> Undoer:
        """The ``Undoer`` over these parts (``restore_here``: recovery's, to restore a
        migration's tree on this node)."""
        return Undoer(processes=self.processes, store=self.store, clock=self.clock,
                      config=self.config, gpu=self.gpu, restore_here=restore_here,
                      files=self.files)
