"""systemd's notification protocol (sd_notify), without libsystemd."""

from __future__ import annotations

import contextlib
import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
        return True
    return False
