"""Group checkpoints: every process of a distributed job (several ranks, several nodes),
checkpointed all-or-nothing. The group record is written last, only once every member's
checkpoint is committed: a group is listed whole or not at all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupMember:
    node: str
    address: str
    """How the coordinator reached the member's daemon (``unix:PATH`` or ``host:port``)."""
    checkpoint_id: str
    pid: int


@dataclass(frozen=True)
class GroupRecord:
    id: str
    name: str
    created: float
    members: tuple[GroupMember, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "created": self.created,
            "members": [m.__dict__ for m in self.members],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupRecord:
        return cls(
            id=str(data["id"]), name=str(data.get("name", "")),
            created=float(data.get("created", 0.0)),
            members=tuple(GroupMember(**m) for m in data.get("members", ())),
        )
