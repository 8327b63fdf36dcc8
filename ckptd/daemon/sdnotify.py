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


def watchdog_interval_s() -> float | None:
    """How often to send "WATCHDOG=1", in seconds; None when systemd expects no pings.

    Like ``sd_watchdog_enabled(3)``: systemd sets ``$WATCHDOG_USEC`` (the unit's
    ``WatchdogSec=``, in microseconds) and ``$WATCHDOG_PID`` (the process it is meant for) in
    the service's environment. The watchdog is ours only when ``$WATCHDOG_USEC`` is a positive
    integer and ``$WATCHDOG_PID``, if set, is this process's pid (a child that inherited the
    environment must not ping). The interval returned is half the timeout, as systemd
    recommends, so a single late ping never gets the daemon killed.
    """
    raw_usec = os.environ.get("WATCHDOG_USEC", "").strip()
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec, 10)
    except ValueError:
        return None
    if usec <= 0:
        return None
    raw_pid = os.environ.get("WATCHDOG_PID", "").strip()
    if raw_pid:
        try:
            pid = int(raw_pid, 10)
        except ValueError:
            return None
        if pid != os.getpid():
            return None
    return usec / 2 / 1_000_000
