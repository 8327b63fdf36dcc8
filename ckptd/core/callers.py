"""The caller's own process, pinned: what is decided from it is decided from IT.

A caller's pid is the pid of the process that connected (ADR 0001). That process may exit
and its pid be given to another, possibly another user's or root's, while the call is
served (issue 21: a reused pid moved the pid counter of a root-owned container). So a
decision made from the caller's process (the cgroup a restore goes into, the container it
is restored into, the pid namespace whose counter is raised, the caller's child) is made
only inside ``caller_process``: it opens the process at the caller's pid only if it started
when the relay recorded (``Caller.start_time``), and checks again, once the decision is
made, that the process has not exited (a live process keeps its pid, so what was read of
that pid was its own). Otherwise the call is refused with one line: the calling process
exited; call again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ckptd.core.ports import ProcessLookup
from ckptd.domain import Caller, PidState
from ckptd.domain.model import CALLER_GONE
from ckptd.errors import PreconditionFailed

_GONE_STATES = (PidState.FREE, PidState.ZOMBIE)


def caller_gone(caller: Caller, before: str) -> PreconditionFailed:
    """The refusal of a call whose process exited (or whose pid now holds another)."""
    pid = caller.pid or 0
    return PreconditionFailed(
        f"the calling process (pid {pid}) exited before {before} (its pid may belong to "
        "another process now)",
        hint="call again from a running process", pid=pid or None)


@contextlib.contextmanager
def caller_process(processes: ProcessLookup, caller: Caller, before: str) -> Iterator[int]:
    """The caller's pid (> 0), pinned for the block: the process at that pid is the one that
    called (its start time is the one recorded, when recorded), alive on entry and still
    alive when the block ends; PreconditionFailed otherwise, raised before the block runs or
    at its end, so that nothing the block decided is used. ``before`` says what was being
    decided ("its cgroup was told"). Callers with no pid (0, None) must not get here.

    A caller not pinned (``start_time`` 0: made inside the daemon, never one the relay
    identified, which always pins a pid it gives) is taken as its pid says, unchecked."""
    pid = caller.pid or 0
    assert pid > 0, "caller_process needs a caller with a pid"
    if caller.start_time == CALLER_GONE:
        raise caller_gone(caller, before)
    if caller.start_time == 0:
        yield pid
        return
    handle = processes.open(pid, caller.start_time)
    if handle is None:
        raise caller_gone(caller, before)
    try:
        if handle.state() in _GONE_STATES:
            raise caller_gone(caller, before)
        yield pid
        if handle.state() in _GONE_STATES:
            raise caller_gone(caller, before)
    finally:
        handle.close()
