"""Events: what the daemon did, for watchers (``ckptctl events``), metrics and logs."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class EventKind(enum.StrEnum):
    CHECKPOINT_STARTED = "checkpoint.started"
    CHECKPOINT_PROGRESS = "checkpoint.progress"
    CHECKPOINT_COMMITTED = "checkpoint.committed"
    CHECKPOINT_FAILED = "checkpoint.failed"
    RESTORE_STARTED = "restore.started"
    RESTORE_DONE = "restore.done"
    RESTORE_FAILED = "restore.failed"
    RESTORE_LAZY_DONE = "restore.lazy_done"
    RESTORE_LAZY_FAILED = "restore.lazy_failed"
    MIGRATE_DONE = "migrate.done"
    MIGRATE_FAILED = "migrate.failed"
    MIGRATE_SETTLED = "migrate.settled"
    """A migration whose link broke while the target restored: which side runs the job now
    (field ``restored_on``: "target", "source" or "neither")."""
    POLICY_SET = "policy.set"
    POLICY_CLEARED = "policy.cleared"
    POLICY_FIRED = "policy.fired"
    SPOT_NOTICE = "spot.notice"
    DRAIN = "drain"
    RESUME = "resume"
    GC_DONE = "gc.done"


@dataclass(frozen=True)
class Event:
    """One thing that happened. ``fields`` holds the figures of the kind (bytes, seconds,
    ratios, the error for failures), numbers or strings."""

    seq: int
    time: float
    kind: EventKind
    pid: int = 0
    checkpoint_id: str = ""
    name: str = ""
    message: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)
    uid: int = -1
    """Whose job it concerns (-1: the node's, e.g. a spot notice): non-root watchers see
    only their own and the node's."""

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "time": self.time, "kind": self.kind.value, "pid": self.pid,
            "checkpoint_id": self.checkpoint_id, "name": self.name, "message": self.message,
            "fields": dict(self.fields), "uid": self.uid,
        }
