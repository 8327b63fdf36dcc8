"""Issue 14: one unprivileged user cannot exhaust the daemon.

2000 idle connections from uid 65534 (a child that setuid's) leave the daemon's threads and
fds bounded (the relay is one thread; a uid holds at most ``max_connections_per_uid``), while
root's dump completes; the user's calls beyond ``max_calls_per_uid`` are refused at once with
RESOURCE_EXHAUSTED, and root's calls are still served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import Daemon, Procs, assert_ok, assert_running, cli_for_uid, workload

pytestmark = pytest.mark.integration

NOBODY = 65534
FLOOD = 2000
PER_UID = 32

HOLD = """
import socket, sys
held, refused = [], 0
for _ in range({n}):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect({path!r})
        held.append(s)
    except OSError:
        refused += 1
        s.close()
print(len(held), refused, flush=True)
sys.stdin.read()
"""

HELD_STREAMS = """
import grpc, sys, time
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb, ckptd_pb2_grpc
channel = grpc.insecure_channel("unix:" + {path!r})
stub = ckptd_pb2_grpc.CheckpointerStub(channel)
calls = [stub.Watch(pb.WatchRequest(follow=True), timeout=60) for _ in range({n})]
time.sleep(2.0)
print(" ".join("OPEN" if not c.done() else c.code().name for c in calls), flush=True)
sys.stdin.read()
"""

STREAMS = """
import grpc, sys
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb, ckptd_pb2_grpc
channel = grpc.insecure_channel("unix:" + {path!r})
stub = ckptd_pb2_grpc.CheckpointerStub(channel)
calls = [stub.Watch(pb.WatchRequest(follow=True), timeout=3) for _ in range({n})]
codes = []
for c in calls:
    try:
        next(c)
    except StopIteration:
        codes.append("END")
    except grpc.RpcError as e:
        codes.append(e.code().name)
    except Exception as e:
        codes.append(type(e).__name__)
print(" ".join(codes), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def open_daemon(start_daemon: Any) -> Iterator[Daemon]:
    """A daemon any uid may reach, with small per-uid limits (to keep the test fast)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-it-flood-", dir="/tmp"))
    try:
        sock_dir.chmod(0o755)
        yield start_daemon(config={"socket_mode": "666", "max_connections_per_uid": PER_UID,
                                   "max_calls_per_uid": 3, "max_open_streams_per_uid": 3},
                           socket_dir=sock_dir / "run")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def threads_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def as_nobody(code: str, uid: int = NOBODY) -> subprocess.Popen[str]:
    argv, env = cli_for_uid(uid)
    return subprocess.Popen(
        [argv[0], "-c", code], user=uid, group=uid, extra_groups=[], cwd="/",
        env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def test_a_connection_flood_is_bounded_and_roots_dump_completes(
    open_daemon: Daemon, procs: Procs
) -> None:
    d = open_daemon
    assert_ok(d.ctl("list"), "list")
    threads_before, fds_before = threads_and_fds(d.pid)
    flood = as_nobody(HOLD.format(n=FLOOD, path=str(d.socket)))
    try:
        assert flood.stdout is not None
        held, refused = map(int, flood.stdout.readline().split())
        assert held + refused == FLOOD
        time.sleep(1.0)  # let the relay accept (and close) what it refuses
        threads, fds = threads_and_fds(d.pid)
        assert threads - threads_before < 10, f"{threads_before} -> {threads} threads"
        assert fds - fds_before <= 3 * PER_UID + 20, f"{fds_before} -> {fds} fds"

        job = procs.popen(workload("counter", "--steps", 100000), start_new_session=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        time.sleep(0.2)
        started = time.monotonic()
        ck = assert_ok(d.ctl("dump", job.pid, "--leave-running", timeout=60), "root's dump")
        assert ck["pid"] == job.pid and time.monotonic() - started < 30
        assert_running(job.pid, "after root's dump under a flood")
    finally:
        flood.kill()
        flood.wait()
    assert "connection refused: uid 65534 holds" in d.log()


def test_a_user_at_its_connection_limit_is_told_so_and_what_to_do(open_daemon: Daemon) -> None:
    """Issue 33 (7): uid 65534 holds its ``max_connections_per_uid`` connections; its
    ``ckptctl list`` is refused by the relay, and says so in one line naming the setting and
    what to do (it said "ckptd went away ... check that it runs"). Root is still served."""
    d = open_daemon
    holder = as_nobody(HOLD.format(n=PER_UID, path=str(d.socket)))
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == [str(PER_UID), "0"]
        refused = d.ctl("list", user=NOBODY)
        assert_ok(d.ctl("list"), "root's list beside a user at its limit")
    finally:
        holder.kill()
        holder.wait()
    assert refused.rc != 0
    line = refused.err.strip()
    assert "\n" not in line, refused.err
    assert line == (f"ckptctl: ckptd refused this connection: uid {NOBODY} holds {PER_UID} "
                    f"connections to ckptd already (max_connections_per_uid {PER_UID}); close "
                    "some of them (other ckptctl or clients of this uid still connected) and "
                    "retry, or raise it in the daemon's configuration"), line
    assert_ok(d.ctl("list", user=NOBODY), "the user's list once its connections closed")


def test_a_users_calls_beyond_its_limit_are_refused_and_root_is_served(
    open_daemon: Daemon
) -> None:
    """uid 65534 opens 6 ``events --follow`` streams (each holds a worker until it ends):
    3 are served, 3 refused at once (``max_open_streams_per_uid``: issue 21 took such streams
    out of the call slots); root's calls go on meanwhile."""
    d = open_daemon
    streams = as_nobody(STREAMS.format(n=6, path=str(d.socket)))
    try:
        time.sleep(0.5)
        started = time.monotonic()
        assert_ok(d.ctl("list"), "root's list while a user holds its calls")
        assert time.monotonic() - started < 10
        assert streams.stdout is not None
        codes = sorted(streams.stdout.readline().split())
    finally:
        streams.kill()
        streams.wait()
    assert codes == ["DEADLINE_EXCEEDED"] * 3 + ["RESOURCE_EXHAUSTED"] * 3, codes
    assert ("too many open streams from uid 65534: 3 open (max_open_streams_per_uid 3)"
            in d.log())


OTHER_USER = 65533


@pytest.fixture
def default_limits_daemon(start_daemon: Any) -> Iterator[Daemon]:
    """A daemon any uid may reach, with the default per-uid limits."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-it-streams-", dir="/tmp"))
    try:
        sock_dir.chmod(0o755)
        yield start_daemon(config={"socket_mode": "666"}, socket_dir=sock_dir / "run")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_two_users_idle_follow_streams_never_block_their_calls(
    default_limits_daemon: Daemon
) -> None:
    """Issue 21 (10): two users each open 6 idle ``events --follow`` streams. Before, they
    took the 12 call slots of all users (``max_user_calls``) for as long as they stayed open,
    and every user's `list` was refused. Now each uid has 4 stream slots of its own (the 5th
    and 6th are refused at once, with the setting named) and both users' calls are served."""
    d = default_limits_daemon
    holders = [as_nobody(HELD_STREAMS.format(n=6, path=str(d.socket)), uid)
               for uid in (NOBODY, OTHER_USER)]
    try:
        codes = []
        for h in holders:
            assert h.stdout is not None
            codes.append(h.stdout.readline().split())
        for uid in (NOBODY, OTHER_USER, None):
            started = time.monotonic()
            assert assert_ok(d.ctl("list", user=uid), f"list as {uid} beside idle streams") == []
            assert time.monotonic() - started < 20
    finally:
        for h in holders:
            h.kill()
            h.wait()
    for got in codes:
        assert sorted(got) == ["OPEN"] * 4 + ["RESOURCE_EXHAUSTED"] * 2, codes
    for uid in (NOBODY, OTHER_USER):
        assert (f"too many open streams from uid {uid}: 4 open (max_open_streams_per_uid 4)"
                in d.log())
