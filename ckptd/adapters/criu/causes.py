"""CRIU's failures said as causes a user understands, with what to do.

CRIU reports the symptom it met (``SEIZE 4242: task not stopped after seize``, ``Unable to
detach 4242: No such process``, ``External socket is used``); ckptd's error must name the cause
(another tracer, a socket to a process outside the tree, a missing capability) and the way out.
``explain`` is consulted by the swrk adapter for every failed CRIU call; a failure it does not
recognise keeps CRIU's own first error.

Invariant: ``explain`` reads only the log text it is given and /proc (the tracer's pid); it
never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_TRACED = re.compile(
    r"SEIZE \d+:|Unseizable non-zombie|Unable to detach|can't interrupt task|"
    r"Can't interrupt the \d+ task|Cannot interrupt the \d+ task", re.IGNORECASE)
_EXTERNAL_UNIX = re.compile(r"External socket (is used|found in image)", re.IGNORECASE)
_CAPABILITY = re.compile(
    r"CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE|Effective capability \d+ missing")
_RLIMIT = re.compile(r"Can't get rlimit \d+: Operation not permitted")
"""prlimit(2) on a process of another uid, refused without CAP_SYS_RESOURCE (CRIU's own
RLIMIT_NOFILE notice at its start is harmless and not this)."""
_GHOST = re.compile(r"Can't dump ghost file (\S+) of (\d+) size, increase limit")
"""A deleted file the tree holds (PyTorch's shared memory: unlinked /dev/shm files) over
CRIU's ghost-file limit; CRIU names the file and its allocated size, not the limit."""
_IN_FLIGHT = re.compile(r"In-flight connection \(l\) for")
"""A listening TCP socket with connections not yet accepted, refused by a CRIU that ignores
``tcp_skip_in_flight`` (ckptd always sets it: CRIU 4 skips them)."""
_PID_IN = re.compile(r"(?:SEIZE|detach(?: from)?|non-zombie|the) (\d+)")


_CAPS_HINT = ("run ckptd as root with its full capabilities (check the unit's "
              "CapabilityBoundingSet, or the container's --cap-add / --privileged)")


@dataclass(frozen=True)
class Cause:
    message: str
    """What went wrong, in the user's terms (no "CRIU ... failed:" prefix)."""
    hint: str
    """What to do."""


def explain(what: str, log_text: str, pid: int | None, proc: Path = Path("/proc"),
            *, ghost_limit: int | None = None) -> Cause | None:
    """The cause of CRIU's failure of ``what`` (``"dump of pid 42"``) told by ``log_text``
    (its log and first error), or None when none is recognised. ``ghost_limit``: the limit
    CRIU was given (bytes), said when a ghost file exceeds it."""
    ghost = _GHOST.search(log_text)
    if ghost:
        limit = f" the limit of {_size(ghost_limit)}" if ghost_limit is not None else " the limit"
        return Cause(
            f"CRIU {what} failed: the tree holds the deleted file {ghost[1]} "
            f"({_size(int(ghost[2]))}, a ghost file: shared memory such as PyTorch's is one) "
            f"and ghost files are dumped up to{limit} (ghost_limit)",
            "raise ghost_limit in the daemon's configuration above the file's size "
            "(bytes, at most 4 GiB - 1) and restart it")
    if _CAPABILITY.search(log_text):
        return Cause(
            f"CRIU {what} failed: CRIU lacks the capabilities it needs (CAP_SYS_ADMIN or "
            "CAP_CHECKPOINT_RESTORE, and CAP_SYS_RESOURCE for processes of other uids)",
            _CAPS_HINT)
    if _RLIMIT.search(log_text):
        tree = f"the tree of pid {pid}" if pid is not None else "the tree"
        return Cause(
            f"CRIU {what} failed: CRIU may not read the rlimits of a process of {tree} "
            "(prlimit: Operation not permitted): the daemon lacks CAP_SYS_RESOURCE, which "
            "processes of another uid need",
            f"give ckptd CAP_SYS_RESOURCE: {_CAPS_HINT}")
    if _EXTERNAL_UNIX.search(log_text):
        return Cause(
            f"CRIU {what} failed: the tree has a Unix socket connected to a process outside "
            "it (an external unix socket), which a restore could not reconnect",
            "close that connection in the job (stdout/stderr on a socket: redirect them to "
            "a file or pipe), or checkpoint the peer process together with it")
    if _IN_FLIGHT.search(log_text):
        return Cause(
            f"CRIU {what} failed: a listening TCP socket of the tree has connections it has "
            "not accepted yet, and this CRIU does not skip them (tcp_skip_in_flight)",
            "use a CRIU that honours tcp_skip_in_flight (`ckptctl check` names the one "
            "ckptd runs), or checkpoint when the job has accepted its pending connections")
    if _TRACED.search(log_text):
        tracer = _tracer_of(_traced_pid(log_text) or pid, proc)
        who = pid if pid is not None else _traced_pid(log_text)
        if tracer:
            pid_, tracer_pid = tracer
            message = (f"CRIU {what} failed: pid {pid_} is being traced by PID {tracer_pid} "
                       "(strace/gdb?)")
        else:
            message = (f"CRIU {what} failed: a process of the tree of pid {who} could not be "
                       "seized (traced by another process such as strace or gdb, or it "
                       "exited meanwhile)")
        return Cause(message, "detach the tracer and retry")
    return None


def _traced_pid(log_text: str) -> int | None:
    match = _PID_IN.search(log_text)
    return int(match[1]) if match else None


def _tracer_of(pid: int | None, proc: Path) -> tuple[int, int] | None:
    """(pid, its tracer) when ``pid`` is traced now; None otherwise."""
    if not pid:
        return None
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("TracerPid:"):
            parts = line.split()
            if len(parts) > 1 and parts[1].isdigit() and parts[1] != "0":
                return pid, int(parts[1])
    return None


def _size(n: int) -> str:
    """Bytes as the user reads them (``6.0 MiB``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"
