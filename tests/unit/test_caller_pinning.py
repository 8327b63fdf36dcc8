"""Issue 21 (8): the caller is the process that connected, pinned by the relay (a pidfd, its
start time), never whatever process holds its pid later. Over real sockets for the relay's
part, over the fakes for the decisions made from the caller's process."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from ckptd.core.callers import caller_process
from ckptd.domain import Caller, PidState
from ckptd.domain.model import CALLER_GONE
from ckptd.errors import PreconditionFailed
from ckptd.transport.grpc import peercred
from ckptd.transport.grpc.peercred import caller_from_peer, peer_start_time

from .world import JOB, USER, World

CONTAINER = frozenset({"pid", "mnt", "net", "ipc", "uts", "cgroup"})
ROOTS_INIT = 6000
"""A root-owned container's init (pid 1 of its pid namespace), at a pid a caller had."""


def _start_time(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2:].split()[19])


@pytest.mark.parametrize("how", ["SO_PEERPIDFD", "pidfd_open"])
def test_the_relay_pins_the_process_that_connected(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "pidfd_open":  # a kernel before 6.5: ENOPROTOOPT, then pidfd_open(pid)
        monkeypatch.setattr(peercred, "SO_PEERPIDFD", 0x7FFF)
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_start_time(b, os.getpid()) == _start_time(os.getpid())
        assert peer_start_time(b, 0) == 0  # outside the daemon's pid namespace: no pid


@pytest.mark.parametrize("how", ["SO_PEERPIDFD", "pidfd_open"])
def test_a_process_that_connected_and_exited_is_gone(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "pidfd_open":
        monkeypatch.setattr(peercred, "SO_PEERPIDFD", 0x7FFF)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "s")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        child = os.fork()
        if child == 0:  # connect, then exit at once
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            os._exit(0)
        os.waitpid(child, 0)  # exited and reaped: its pid is free for anyone
        conn, _ = listener.accept()
        with conn, listener:
            assert peer_start_time(conn, child) == CALLER_GONE


def test_the_peer_path_carries_the_start_time(tmp_path: Path) -> None:
    assert caller_from_peer(f"unix:{tmp_path}/1000-4242-987654-7", tmp_path) == Caller(
        uid=1000, pid=4242, start_time=987654)
    assert caller_from_peer(f"unix:{tmp_path}/1000-4242--1-8", tmp_path) == Caller(
        uid=1000, pid=4242, start_time=CALLER_GONE)
    assert caller_from_peer(f"unix:{tmp_path}/1000-4242-8", tmp_path) is None  # old form


def _reused(world: World, pid: int) -> Caller:
    """A user's caller whose process exited; its pid now holds a root-owned container's init.
    The caller as the relay recorded it (its own start time, not the newcomer's)."""
    world.processes.add_process(pid, 1, comm="init", uid=0, ns_pid=1, namespaces=CONTAINER)
    world.processes.processes[pid].own_root = True
    newcomer = world.processes.processes[pid].start_time
    return Caller(uid=USER.uid, pid=pid, start_time=newcomer - 1)


def test_a_reused_pid_never_gets_its_pid_counter_moved(world: World) -> None:
    """The finding: after pid reuse, a user moved the pid counter of a root-owned pid
    namespace (ReservePids). Refused in one line; the counter is untouched."""
    caller = _reused(world, ROOTS_INIT)
    with pytest.raises(PreconditionFailed, match=r"the calling process \(pid 6000\) exited "
                       r"before its pid namespace's pids could be reserved.*call again"):
        world.service.reserve_pids(caller, 1000)
    assert world.processes.pid_counters == {}
    same = Caller(uid=0, pid=ROOTS_INIT, start_time=world.processes.processes[ROOTS_INIT]
                  .start_time)
    assert world.service.reserve_pids(same, 1000) == 1000  # the pinned process: served


def test_a_gone_caller_is_refused_whatever_holds_its_pid(world: World) -> None:
    with pytest.raises(PreconditionFailed, match="exited before"):
        world.service.reserve_pids(Caller(uid=0, pid=ROOTS_INIT, start_time=CALLER_GONE), 1)
    assert world.processes.pid_counters == {}


def test_a_reused_pid_never_chooses_a_restores_cgroup(world: World) -> None:
    """A user's restore goes into the caller's cgroup: never into the cgroup of a process
    that took the caller's pid."""
    record = world.dump(JOB)
    caller = _reused(world, ROOTS_INIT)
    world.cgroups.place(ROOTS_INIT, "/root-only/service")
    with pytest.raises(PreconditionFailed, match=r"pid 6000\) exited before the cgroup"):
        world.restore(caller, checkpoint_id=record.id)
    assert world.criu.restore_jobs == []


def test_the_caller_exiting_while_a_decision_is_made_voids_it(world: World) -> None:
    world.processes.add_process(4242, 1, comm="ckptctl", uid=USER.uid)
    caller = Caller(uid=USER.uid, pid=4242,
                    start_time=world.processes.processes[4242].start_time)
    decided = []
    with pytest.raises(PreconditionFailed, match="exited before its cgroup was told"), \
            caller_process(world.processes, caller, "its cgroup was told") as pid:
        world.processes.processes[pid].state = PidState.ZOMBIE  # exits meanwhile
        decided.append(pid)
    assert decided == [4242]  # what the block decided is never returned
    with pytest.raises(PreconditionFailed, match="exited before x"), caller_process(
        world.processes, caller, "x"
    ):  # gone on entry: refused before the block runs
        decided.append(0)
    assert decided == [4242]
