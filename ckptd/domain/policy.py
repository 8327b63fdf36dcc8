"""Policies: what the daemon does for a job on its own (periodic checkpoints, retention, a
checkpoint before termination), and what it remembers of doing it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``500ms`` -> seconds; ValueError otherwise."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"invalid duration {text!r}: use e.g. 30s, 15m, 2h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Policy:
    """The policy of one job, by name. ``pid`` is the job's root process here (0: none);
    ``on_term``: the job is protected (checkpointed on drain, spot notice, termination).
    The ``last_*`` and ``drained_checkpoint_id`` fields are the daemon's record."""

    name: str
    pid: int = 0
    every_s: float = 0.0
    keep: int = 0
    on_term: bool = False
    uid: int = 0
    last_fired: float = 0.0
    last_checkpoint_id: str = ""
    last_error: str = ""
    drained_checkpoint_id: str = ""
    started: int = 0
    """The job's start time (``PidStatus.start_time``) when ``pid`` was recorded: a pid that
    now belongs to another process is never checkpointed for this job."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
