"""The ports of ckptd's core: what it needs from the outside world, as Protocols.

Each port has a real adapter under ``ckptd.adapters`` and a fake in ``ckptd.testing``; both
pass the same contract suite under ``tests/contract``.

The ports are grouped by family, one module each (``node``, ``process``, ``files``, ``criu``,
``gpu``, ``store``, ``peer``, ``state``); this package re-exports every name, so that
``from ckptd.core.ports import X`` keeps working.
"""

from __future__ import annotations

from ckptd.core.ports.criu import (
    Criu,
    CriuCreates,
    CriuDumpInProgress,
    CriuDumpJob,
    CriuDumpResult,
    CriuHooks,
    CriuPaths,
    CriuPlacement,
    CriuRestoreJob,
    ForwardingHooks,
    ImageSource,
    InheritFd,
    LazyPages,
    PageSink,
)
from ckptd.core.ports.files import (
    DirFiles,
    FileCheck,
    JobFiles,
    NotCaptured,
    PinnedPaths,
    Precopy,
    PutBack,
    SharedFile,
    StdioProvider,
    WrittenFile,
)
from ckptd.core.ports.gpu import (
    CudaProcessFact,
    CudaProcessFacts,
    GpuCheckpointer,
    GpuInventoryPort,
)
from ckptd.core.ports.node import (
    Cgroups,
    Clock,
    MemoryLimit,
    NodeInspector,
)
from ckptd.core.ports.peer import (
    CheckpointExport,
    ExportedImage,
    FrameKeeper,
    PageExchange,
    PageFrame,
    PeerConnector,
    PeerLink,
    PeerSession,
    PlaceRun,
)
from ckptd.core.ports.process import (
    PidNamespaces,
    ProcessHandle,
    ProcessLookup,
    ProcessTable,
    ProcessTrees,
    ThreadHold,
)
from ckptd.core.ports.state import (
    GuardPhase,
    Journal,
    PolicyRepo,
    TreeGuard,
)
from ckptd.core.ports.store import (
    BlobStore,
    CheckpointCatalog,
    CheckpointCheckouts,
    CheckpointStaging,
    CheckpointStore,
    GroupRecords,
    StoreMaintenance,
)

__all__ = [
    "BlobStore",
    "Cgroups",
    "CheckpointCatalog",
    "CheckpointCheckouts",
    "CheckpointExport",
    "CheckpointStaging",
    "CheckpointStore",
    "Clock",
    "Criu",
    "CriuCreates",
    "CriuDumpInProgress",
    "CriuDumpJob",
    "CriuDumpResult",
    "CriuHooks",
    "CriuPaths",
    "CriuPlacement",
    "CriuRestoreJob",
    "CudaProcessFact",
    "CudaProcessFacts",
    "DirFiles",
    "ExportedImage",
    "FileCheck",
    "ForwardingHooks",
    "FrameKeeper",
    "GpuCheckpointer",
    "GpuInventoryPort",
    "GroupRecords",
    "GuardPhase",
    "ImageSource",
    "InheritFd",
    "JobFiles",
    "Journal",
    "LazyPages",
    "MemoryLimit",
    "NodeInspector",
    "NotCaptured",
    "PageExchange",
    "PageFrame",
    "PageSink",
    "PeerConnector",
    "PeerLink",
    "PeerSession",
    "PidNamespaces",
    "PinnedPaths",
    "PlaceRun",
    "PolicyRepo",
    "Precopy",
    "ProcessHandle",
    "ProcessLookup",
    "ProcessTable",
    "ProcessTrees",
    "PutBack",
    "SharedFile",
    "StdioProvider",
    "StoreMaintenance",
    "ThreadHold",
    "TreeGuard",
    "WrittenFile",
]
