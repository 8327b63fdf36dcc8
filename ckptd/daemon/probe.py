"""What this node can do (the Check RPC): CRIU, kernel features, GPUs."""

from __future__ import annotations

import os
import socket

from ckptd.adapters.criu import CriuSwrk
from ckptd.domain import Feature, NodeReport

FEATURES = (
    ("mem_dirty_track", "soft-dirty memory tracking (CRIU pre-dump / incremental dumps)"),
    ("lazy_pages", "userfaultfd lazy restore"),
    ("network_lock_nftables", "network locking with nftables (TCP connections)"),
)


def gpu_status() -> tuple[bool, str]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return False, "GPU support not installed (nvidia-ml-py missing): CPU checkpoints only"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return False, f"no usable NVIDIA driver ({exc}): CPU checkpoints only"
    return count > 0, f"{count} NVIDIA GPU(s) seen; GPU checkpointing is not implemented yet"


class NodeProbe:
    def __init__(self, criu: CriuSwrk, node: str, store: str) -> None:
        self._criu = criu
        self._node = node or socket.gethostname()
        self._store = store

    def __call__(self) -> NodeReport:
        criu = self._criu.status()
        features: tuple[Feature, ...] = ()
        if criu.ok:
            features = tuple(
                Feature(name, self._criu.feature(name), detail) for name, detail in FEATURES
            )
        gpu_ok, gpu_msg = gpu_status()
        return NodeReport(
            node=self._node,
            kernel=os.uname().release,
            criu=criu,
            features=features,
            gpu_available=gpu_ok,
            gpu_message=gpu_msg,
            store=self._store,
        )
