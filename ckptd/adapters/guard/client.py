"""``TreeGuard`` over a guard process (``process``): the daemon's side.

The guard is started once (``start``, or at the first dump), with one end of a SOCK_SEQPACKET
socketpair; the daemon keeps the other end, close-on-exec, for its whole life, so the guard
sees the stream end exactly when the daemon is dead (or has exited: then nothing is watched).
Each member of a watched tree is sent as a pidfd opened here with its start time checked
(``PidfdHandle.open``): the guard holds the very processes the dump held.

Invariants: a call never raises and never blocks long (a send times out after
``SEND_TIMEOUT_S``); what each operation told the guard is kept here until it is released, so
a guard that died is started again and told everything still in flight before the next
message; a failure is logged and the operation goes on, covered by the journal alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ckptd
from ckptd.adapters.guard import wire
from ckptd.adapters.procfs.pidfd import PidfdHandle
from ckptd.core.ports import GuardPhase

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
LOCK_NAME = "guard.lock"


@dataclass
class _Op:
    leave_running: bool
    stopped_before: frozenset[int]
    members: dict[int, int] = field(default_factory=dict)
    phase: GuardPhase = GuardPhase.STOPPED


class PidfdTreeGuard:
    """The ``TreeGuard`` port; thread-safe (one lock around the socket and the state)."""

    def __init__(self, state_dir: Path, journal_dir: Path, *,
                 traced_wait_s: float | None = None) -> None:
        self._lock_path = state_dir / LOCK_NAME
        self._journal = journal_dir
        self._traced_wait_s = traced_wait_s
        self._mutex = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ops: dict[str, _Op] = {}

    @property
    def pid(self) -> int:
        """The guard process's pid (0 when none runs)."""
        with self._mutex:
            return self._proc.pid if self._alive() and self._proc is not None else 0

    def start(self) -> bool:
        """Start the guard now (it otherwise starts at the first dump); False if it cannot."""
        with self._mutex:
            return self._ensure() or self._alive()

    def watch(self, op_id: str, members: Sequence[Sequence[int]],
              stopped_before: frozenset[int], leave_running: bool) -> None:
        with self._mutex:
            op = self._ops.setdefault(op_id, _Op(leave_running, stopped_before))
            op.leave_running, op.stopped_before = leave_running, stopped_before
            new = {int(m[0]): int(m[1]) for m in members if int(m[0]) not in op.members}
            op.members.update(new)
            if self._ensure():
                self._send_watch(op_id, op, new)

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        with self._mutex:
            op = self._ops.get(op_id)
            if op is None:
                return
            op.phase = phase
            if self._ensure():
                self._send(wire.phase(op_id, phase))

    def release(self, op_id: str) -> None:
        with self._mutex:
            if self._ops.pop(op_id, None) is not None and self._ensure():
                self._send(wire.release(op_id))

    # ---- the process ------------------------------------------------------------------------

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._sock is not None

    def _ensure(self) -> bool:
        """True when the guard was running already (the caller sends its message). Else a
        guard is started and told everything in flight, this state included (False: the
        caller sends nothing more), or none could be started (False)."""
        if self._alive():
            return True
        if self._proc is not None:
            log.error("the guard process (pid %d) is gone (exit %s): starting another",
                      self._proc.pid, self._proc.returncode)
        self._stop()
        if self._spawn():
            for op_id, op in self._ops.items():
                self._send_watch(op_id, op, op.members)
                if op.phase is not GuardPhase.STOPPED:
                    self._send(wire.phase(op_id, op.phase))
        return False

    def _spawn(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.settimeout(SEND_TIMEOUT_S)
        here = str(Path(ckptd.__file__).resolve().parent.parent)  # the daemon's own code
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH"))
                                             if p)}
        argv = [sys.executable, "-m", "ckptd.adapters.guard.process", "--fd",
                str(theirs.fileno()), "--lock", str(self._lock_path),
                "--journal", str(self._journal)]
        if self._traced_wait_s is not None:
            argv += ["--traced-wait", str(self._traced_wait_s)]
        try:
            self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),),
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=env)
        except OSError as exc:
            log.error("cannot start the guard process: %s (a daemon killed during a dump "
                      "leaves its tree to the next start)", exc)
            ours.close()
            return False
        finally:
            theirs.close()
        self._sock = ours
        log.info("guard process started (pid %d)", self._proc.pid)
        return True

    def _stop(self) -> None:
        """Forget the guard: killed first (our child, not reaped yet: its pid is its own),
        so that it never takes the closed stream for the daemon's death and acts."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=SEND_TIMEOUT_S)
            self._proc = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send_watch(self, op_id: str, op: _Op, members: dict[int, int]) -> None:
        self._send(wire.watch(op_id, op.leave_running, op.stopped_before))
        batch: list[tuple[int, int]] = []
        handles: list[PidfdHandle] = []
        try:
            for pid, start in members.items():
                handle = PidfdHandle.open(pid, start)
                if handle is None:
                    continue  # gone already: nothing to guard
                handles.append(handle)
                batch.append((pid, handle.start_time))
                if len(batch) == wire.MAX_FDS:
                    self._send(wire.hold(op_id, batch), [h.fileno() for h in handles])
                    batch, handles = [], self._closed(handles)
            if batch:
                self._send(wire.hold(op_id, batch), [h.fileno() for h in handles])
        finally:
            self._closed(handles)

    @staticmethod
    def _closed(handles: list[PidfdHandle]) -> list[PidfdHandle]:
        for handle in handles:
            handle.close()
        return []

    def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        if self._sock is None:
            return
        try:
            socket.send_fds(self._sock, [data], list(fds))
        except OSError as exc:
            level = logging.ERROR if exc.errno != errno.EPIPE else logging.WARNING
            log.log(level, "cannot reach the guard process: %s", exc or "timed out")
            self._stop()


def wait_for_guards(state_dir: Path, timeout_s: float) -> bool:
    """Wait until no guard of an earlier daemon on ``state_dir`` runs (they hold
    ``guard.lock`` shared until they have acted and exit): recovery must not overlap a guard
    still acting. False when one still runs after ``timeout_s``."""
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)
