"""The messages between the daemon and its guard: one JSON object per SOCK_SEQPACKET message,
pidfds alongside (SCM_RIGHTS).

    {"t": "watch", "op": ID, "leave_running": bool, "stopped_before": [pid, ...]}
    {"t": "hold", "op": ID, "members": [[pid, start time], ...]}      + one pidfd per member
    {"t": "phase", "op": ID, "phase": "stopped" | "unsure" | "committed"}
    {"t": "release", "op": ID}

Nothing comes back: the daemon never waits for its guard. The end of the stream (every copy
of the daemon's end closed: the daemon is dead) is what the guard acts on; messages sent
before are still read first, so a phase sent is a phase known.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ckptd.core.ports import GuardPhase

MAX_FDS = 200
"""Pidfds per message (the kernel takes at most 253, SCM_MAX_FD)."""
MAX_MESSAGE = 1 << 20
_OP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class BadMessage(ValueError):
    """A message the guard cannot use (it is logged and dropped)."""


@dataclass(frozen=True)
class Message:
    kind: str
    op_id: str
    leave_running: bool = False
    stopped_before: frozenset[int] = frozenset()
    members: tuple[tuple[int, int], ...] = ()
    phase: GuardPhase = GuardPhase.STOPPED


def watch(op_id: str, leave_running: bool, stopped_before: frozenset[int]) -> bytes:
    return _dump({"t": "watch", "op": op_id, "leave_running": leave_running,
                  "stopped_before": sorted(stopped_before)})


def hold(op_id: str, members: list[tuple[int, int]]) -> bytes:
    return _dump({"t": "hold", "op": op_id, "members": [list(m) for m in members]})


def phase(op_id: str, value: GuardPhase) -> bytes:
    return _dump({"t": "phase", "op": op_id, "phase": value.value})


def release(op_id: str) -> bytes:
    return _dump({"t": "release", "op": op_id})


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse(data: bytes, nfds: int) -> Message:
    """One message, checked (op ids are journal file names: no path characters). Raises
    BadMessage."""
    try:
        obj = json.loads(data)
        kind, op_id = obj["t"], obj["op"]
        if not isinstance(op_id, str) or not _OP_ID.fullmatch(op_id):
            raise BadMessage(f"bad operation id {op_id!r}")
        if kind == "watch":
            return Message(kind, op_id, leave_running=bool(obj["leave_running"]),
                           stopped_before=frozenset(_int(p) for p in obj["stopped_before"]))
        if kind == "hold":
            members = tuple((_int(m[0]), _int(m[1])) for m in obj["members"])
            if len(members) != nfds:
                raise BadMessage(f"{len(members)} members, {nfds} pidfds")
            return Message(kind, op_id, members=members)
        if kind == "phase":
            return Message(kind, op_id, phase=GuardPhase(obj["phase"]))
        if kind == "release":
            return Message(kind, op_id)
    except BadMessage:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise BadMessage(f"malformed message: {exc}") from exc
    raise BadMessage(f"unknown message {kind!r}")


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadMessage(f"not a pid or start time: {value!r}")
    return value
