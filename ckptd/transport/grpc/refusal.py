"""The line the caller relay (``peercred``) writes to a connection it refuses, and how a
client reads it back. Standard library only: ``ckptctl`` imports it on a failed call without
loading the daemon's modules."""

from __future__ import annotations

import socket

REFUSED = b"ckptd refused this connection: "
"""How the relay's one line to a connection it refuses begins (``refusal_line``): a client
whose call failed reads it with ``refusal_of`` (gRPC itself only sees a closed socket)."""


def refusal_line(why: str) -> bytes:
    """The line a refused connection gets before it is closed: why, and what to do."""
    todo = ("close some of them (other ckptctl or clients of this uid still connected) and "
            "retry, or raise it in the daemon's configuration"
            if "max_connections_per_uid" in why else
            "retry later, or raise it in the daemon's configuration")
    return REFUSED + f"{why}; {todo}\n".encode()


def refusal_of(public: str, timeout_s: float = 0.5) -> str:
    """Why the relay at ``public`` refuses this process's uid now ("" when it does not, or
    cannot be told): a fresh connection is refused the same way while the uid is at its
    limit, and then reads the relay's line. An admitted connection reads nothing (the gRPC
    server waits for a client's first bytes) or gRPC's frames: ""."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout_s)
            probe.connect(public)
            data = b""
            while len(data) < 1024 and not data.endswith(b"\n"):
                chunk = probe.recv(1024 - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError:  # not there, not ours to reach, or nothing said within the timeout
        return ""
    if not data.startswith(REFUSED):
        return ""
    return data.decode(errors="replace").strip()
