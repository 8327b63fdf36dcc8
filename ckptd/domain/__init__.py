"""Pure data of ckptd: immutable values, no I/O, no knowledge of CRIU, gRPC or GPUs."""

from ckptd.domain.model import (
    Caller,
    CheckpointRecord,
    CriuStatus,
    DumpRequest,
    Feature,
    NodeReport,
    PidState,
    PidStatus,
    ProcessFact,
    Progress,
    RestoreOutcome,
    RestoreRequest,
    StdioFact,
    StdioKind,
    new_checkpoint_id,
)

__all__ = [
    "Caller",
    "CheckpointRecord",
    "CriuStatus",
    "DumpRequest",
    "Feature",
    "NodeReport",
    "PidState",
    "PidStatus",
    "ProcessFact",
    "Progress",
    "RestoreOutcome",
    "RestoreRequest",
    "StdioFact",
    "StdioKind",
    "new_checkpoint_id",
]
