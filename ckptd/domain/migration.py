"""Values of a migration: moving a process tree to another node's daemon."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptd.domain.model import CompatReport


@dataclass(frozen=True)
class MigrateRequest:
    pid: int
    to: str
    """The target daemon's peer address, ``host:port``."""
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    output_path: str = ""
    """On the target: where stdout/stderr go when they were a pipe or a terminal."""
    ignore_warnings: bool = False


@dataclass(frozen=True)
class PeerProbe:
    """What a target daemon says of a checkpoint (or a preview of one), touching nothing."""

    node: str
    store_id: str
    report: CompatReport
    has_checkpoint: bool = False


@dataclass(frozen=True)
class RemoteRestore:
    """The tree as restored on the target."""

    checkpoint_id: str
    pid: int
    output_path: str
    node: str
    restore_s: float = 0.0


@dataclass(frozen=True)
class ReceivedState:
    """What a migration's target says it did with a checkpoint it was sent (``PeerLink.
    received``), from its durable records: ``restored`` (it runs there, as ``pid``), still
    ``restoring`` (ask again), or neither: it never committed a restore of it, and from this
    answer on it never will (the answer is a durable fence there)."""

    checkpoint_id: str
    node: str
    restored: bool = False
    restoring: bool = False
    pid: int = 0
    output_path: str = ""


@dataclass(frozen=True)
class MigrateOutcome:
    checkpoint_id: str
    node: str
    address: str
    pid: int
    output_path: str
    pages_total: int = 0
    pages_sent: int = 0
    bytes_sent: int = 0
    frozen_s: float = 0.0
    downtime_s: float = 0.0
    transfer_s: float = 0.0
    shared_store: bool = False
