"""Policies: what the daemon does for a job on its own (periodic checkpoints, retention, a
checkpoint before termination), and what it remembers of doing it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# re-exported: the forms live in ckptd.textforms, which the CLI imports without the domain
from ckptd.textforms import parse_duration as parse_duration  # noqa: PLC0414
from ckptd.textforms import valid_name as valid_name  # noqa: PLC0414


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
    files_dirs: tuple[str, ...] = ()
    """Output directories each of its checkpoints captures (``DumpRequest.files_dirs``)."""
    started: int = 0
    """The job's start time (``PidStatus.start_time``) when ``pid`` was recorded: a pid that
    now belongs to another process is never checkpointed for this job."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["files_dirs"] = tuple(values.get("files_dirs", ()))
        return cls(**values)
