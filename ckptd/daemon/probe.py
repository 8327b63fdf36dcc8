"""What this node can do (the Check RPC): CRIU, kernel features, GPUs."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from ckptd.adapters.criu import CriuSwrk
from ckptd.core.gpu import GpuSteps
from ckptd.domain import Feature, GpuInventory, NodeReport, RuntimeFacts

FEATURES: tuple[tuple[str, str, Callable[[CriuSwrk], bool]], ...] = (
    ("mem_dirty_track", "soft-dirty memory tracking (CRIU pre-dump / incremental dumps)",
     lambda criu: criu.feature("mem_dirty_track")),
    # What ``restore --lazy`` itself asks (``criu check --feature uffd-noncoop``): CRIU knows
    # no feature named lazy_pages, so asking it by that name always failed.
    ("lazy_pages", "userfaultfd lazy restore (restore --lazy)", CriuSwrk.lazy_restores),
    ("network_lock_nftables", "network locking with nftables (TCP connections)",
     lambda criu: criu.feature("network_lock_nftables")),
)
"""Each feature ``ckptctl check`` reports: its name, what it is for, and how it is asked (the
same question the dump or restore that uses it asks, so the two never disagree)."""


def gpu_status() -> tuple[bool, str]:
    """Whether NVML sees a GPU here, and what it says (for tests and tools)."""
    try:
        from ckptd.adapters.nvml import NvmlInventory
    except ImportError:
        return False, "GPU support not installed (pip install 'ckptd[gpu]'): CPU checkpoints only"
    inv = NvmlInventory().inventory()
    if not inv.available:
        return False, inv.message
    return bool(inv.gpus), inv.message or f"{len(inv.gpus)} NVIDIA GPU(s)"


def gpu_summary(gpu: GpuSteps) -> str:
    """One line for the daemon's start-up log: the GPUs NVML sees and how CUDA processes are
    checkpointed, or why there are no GPU checkpoints here (no driver, no NVML, none
    installed, turned off)."""
    inventory = gpu.node_inventory()
    line = _gpu_message(inventory)
    if inventory.available and inventory.gpus:
        line += f"; CUDA checkpoints: {gpu.describe_checkpointer()}"
    return line


class NodeProbe:
    """The Check RPC's report. ``runtime``: what this node gives containers (cgroups, OCI
    runtimes, CAP_SYS_RESOURCE), read on each call; none by default."""

    def __init__(self, criu: CriuSwrk, node: str, store: str, gpu: GpuSteps,
                 runtime: Callable[[], RuntimeFacts] = RuntimeFacts) -> None:
        self._runtime = runtime
        self._gpu = gpu
        self._criu = criu
        self._node = node or socket.gethostname()
        self._store = store

    def __call__(self) -> NodeReport:
        criu = self._criu.status()
        features: tuple[Feature, ...] = ()
        if criu.ok:
            features = tuple(
                Feature(name, ask(self._criu), detail) for name, detail, ask in FEATURES
            )
        inventory = self._gpu.node_inventory()
        return NodeReport(
            node=self._node,
            kernel=os.uname().release,
            criu=criu,
            features=features,
            gpu_available=inventory.available and bool(inventory.gpus),
            gpu_message=_gpu_message(inventory),
            gpu=inventory,
            store=self._store,
            runtime=self._runtime(),
        )


def _gpu_message(inv: GpuInventory) -> str:
    if not inv.available:
        return f"{inv.message}: CPU checkpoints only"
    if not inv.gpus:
        return "NVIDIA driver present, no GPU"
    cuda = f"{inv.cuda_version // 1000}.{inv.cuda_version % 1000 // 10}"
    return f"driver {inv.driver_version}, CUDA {cuda}, {len(inv.gpus)} GPU(s)"
