"""``ckptd-guard``: the process that watches a daemon's dumps from outside it.

Run by the daemon (``client.PidfdTreeGuard``) as ``python -m ckptd.adapters.guard.process``
with its end of a socketpair. It reads the daemon's messages (``wire``) into a
``core.guard.TreeWatch``, each tree held by the pidfds the daemon sent; when the stream ends
(the daemon is dead, or exited having released everything) it acts on what is still watched
and exits. It holds ``guard.lock`` in the state directory shared for its whole life: a new
daemon takes it exclusively before it recovers (``client.wait_for_guards``), so the guard's
actions and the next daemon's recovery never overlap.

It is in a session of its own and under systemd survives the daemon (``KillMode=process``).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptd.adapters.clock import SystemClock
from ckptd.adapters.guard import wire
from ckptd.adapters.procfs.pidfd import PidfdHandle
from ckptd.adapters.storage.journal import annotate
from ckptd.core.guard import TRACED_WAIT_S, TreeWatch, Verdict
from ckptd.core.undo import with_guard_resumed

log = logging.getLogger("ckptd-guard")
PROC = Path("/proc")


def traced(pid: int) -> bool:
    """Whether ``pid`` has a tracer now (TracerPid in /proc/PID/status)."""
    try:
        with open(PROC / str(pid) / "status") as fh:
            for line in fh:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        return False
    return False


def recorder(journal: Path) -> Callable[[str, Verdict], bool]:
    """Records a verdict in the dead daemon's journal entry (``recover`` reads it)."""

    def record(op_id: str, verdict: Verdict) -> bool:
        del verdict  # only RECORD_RESUME is recorded: a GuardResumed undo record
        return annotate(journal, op_id, with_guard_resumed)

    return record


def apply(watch: TreeWatch, message: wire.Message, fds: Sequence[int]) -> None:
    """One message into ``watch``; the pidfds become handles (or are closed)."""
    if message.kind == "watch":
        watch.watch(message.op_id, message.leave_running, message.stopped_before)
    elif message.kind == "hold":
        watch.hold(message.op_id, [PidfdHandle(fd, pid, start, PROC)
                                   for fd, (pid, start) in zip(fds, message.members, strict=True)])
        return
    elif message.kind == "phase":
        watch.phase(message.op_id, message.phase)
    elif message.kind == "release":
        watch.release(message.op_id)
    for fd in fds:
        os.close(fd)


def serve(sock: socket.socket, watch: TreeWatch) -> None:
    """Read messages until the daemon's end is closed."""
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, wire.MAX_MESSAGE, wire.MAX_FDS)
        except InterruptedError:
            continue
        except OSError as exc:  # ECONNRESET: the daemon is gone as well
            log.warning("reading from the daemon: %s", exc)
            return
        if not data:
            for fd in fds:
                os.close(fd)
            return
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise wire.BadMessage("message or pidfds truncated")
            apply(watch, wire.parse(data, len(fds)), fds)
        except wire.BadMessage as exc:
            log.error("dropped a message from the daemon: %s", exc)
            for fd in fds:
                os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ckptd-guard")
    p.add_argument("--fd", type=int, required=True, help="this end of the daemon's socketpair")
    p.add_argument("--lock", type=Path, required=True, help="guard.lock in the state dir")
    p.add_argument("--journal", type=Path, required=True, help="the daemon's journal dir")
    p.add_argument("--traced-wait", type=float, default=TRACED_WAIT_S)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"ckptd-guard[{os.getpid()}]: %(levelname)s %(message)s")
    _set_name(b"ckptd-guard")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock = os.open(args.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_SH)
    watch = TreeWatch(traced=traced, record=recorder(args.journal), clock=SystemClock(),
                      traced_wait_s=args.traced_wait)
    with socket.socket(fileno=args.fd) as sock:
        serve(sock, watch)
    for line in watch.daemon_gone():
        log.warning("%s", line)
    os.close(lock)
    return 0


def _set_name(name: bytes) -> None:
    """``comm`` of this process (ps, /proc/PID/comm): PR_SET_NAME."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
