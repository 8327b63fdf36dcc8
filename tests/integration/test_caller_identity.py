"""Issue 21 (8): the caller is the process that connected, pinned (a pidfd, its start time),
not its pid: a connection passed on by a process that then exited speaks for nobody once
another process, here a root-owned container's init, holds that pid.

uid 65534 connects from a child, hands the connected socket to its parent (SCM_RIGHTS), and
the child exits; the test makes the child's pid the init of a new, root-owned pid namespace
(``ns_last_pid``, then ``unshare --pid --fork``); the parent then calls ReservePids through
the inherited connection. Before, the daemon moved that root-owned namespace's pid counter;
now the call is refused in one line and the counter is untouched.
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

from .support import NOBODY, Daemon, Procs, cli_for_uid

pytestmark = pytest.mark.integration

ABOVE = 30000
"""The counter ReservePids would set: far above what the test's namespace ever hands out."""

PASS_ON = """
import os, socket, sys, threading
public = {path!r}
here, there = socket.socketpair(socket.AF_UNIX)
child = os.fork()
if child == 0:  # the caller as the daemon saw it: connects, hands the socket on, exits
    s = socket.socket(socket.AF_UNIX)
    s.connect(public)
    socket.send_fds(there, [b"x"], [s.fileno()])
    os._exit(0)
_, (fd,), _, _ = socket.recv_fds(here, 1, 1)
os.waitpid(child, 0)
print(child, flush=True)
sys.stdin.readline()  # the test has given the pid to a root-owned container's init

conn = socket.socket(fileno=fd)
local = {local!r}
listener = socket.socket(socket.AF_UNIX)
listener.bind(local)
listener.listen(1)

def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

def forward():
    client, _ = listener.accept()
    threading.Thread(target=pump, args=(client, conn), daemon=True).start()
    pump(conn, client)

threading.Thread(target=forward, daemon=True).start()
import grpc
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb, ckptd_pb2_grpc
stub = ckptd_pb2_grpc.CheckpointerStub(grpc.insecure_channel("unix:" + local))
try:
    last = stub.ReservePids(pb.ReservePidsRequest(above={above}), timeout=30).last_pid
    print("OK", last, flush=True)
except grpc.RpcError as e:
    print(e.code().name, e.details(), flush=True)
"""


@pytest.fixture
def open_daemon(start_daemon: Any) -> Iterator[Daemon]:
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-it-pin-", dir="/tmp"))
    try:
        sock_dir.chmod(0o755)
        yield start_daemon(config={"socket_mode": "666"}, socket_dir=sock_dir / "run")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _ns_pids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def _container_init_at(pid: int, procs: Procs) -> subprocess.Popen[str] | None:
    """A root-owned process that is pid 1 of a new pid namespace, at node pid ``pid``: a
    shell that has unshared its pid namespace forks it right after ``ns_last_pid`` is set to
    ``pid - 1``; None when another process took the pid first."""
    helper = procs.popen(["unshare", "--pid", "--", "sh", "-c",
                          "read x; sleep 300 & echo $!; wait"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert helper.stdin is not None and helper.stdout is not None
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    helper.stdin.write("go\n")
    helper.stdin.flush()
    got = int(helper.stdout.readline())
    if got == pid and _ns_pids(pid) == [pid, 1]:
        return helper
    helper.kill()
    helper.wait()
    return None


def _counter_of(pid: int) -> int:
    """The pid counter of ``pid``'s pid namespace (read by a process born in it)."""
    out = subprocess.run(["nsenter", "-t", str(pid), "-p", "cat",
                          "/proc/sys/kernel/ns_last_pid"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return int(out)


def test_a_passed_on_connection_never_moves_a_pid_counter_it_does_not_own(
    open_daemon: Daemon, procs: Procs
) -> None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs util-linux's unshare and nsenter")
    d = open_daemon
    argv, env = cli_for_uid(NOBODY)
    work = Path(tempfile.mkdtemp(prefix="ckptd-it-pin-user-", dir="/tmp"))
    os.chown(work, NOBODY, NOBODY)
    user = subprocess.Popen(
        [argv[0], "-c", PASS_ON.format(path=str(d.socket), local=str(work / "fwd"),
                                       above=ABOVE)],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env={**os.environ, **env},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert user.stdout is not None and user.stdin is not None
        caller = int(user.stdout.readline())
        time.sleep(0.1)  # a start time counts clock ticks (10 ms): the newcomer starts later
        init = None
        for _ in range(50):  # another process may take the pid first: try again
            init = _container_init_at(caller, procs)
            if init is not None:
                break
        if init is None:
            pytest.skip(f"could not give pid {caller} to a container's init (busy node)")
        before = _counter_of(caller)
        assert before < ABOVE
        user.stdin.write("go\n")
        user.stdin.flush()
        answer = user.stdout.readline().strip()
        after = _counter_of(caller)
    finally:
        user.kill()
        user.wait()
        shutil.rmtree(work, ignore_errors=True)
    assert after < ABOVE, f"the root-owned namespace's counter was moved to {after}"
    assert answer.startswith("FAILED_PRECONDITION "), answer
    assert (f"the calling process (pid {caller}) exited before its pid namespace's pids "
            "could be reserved" in answer), answer
    assert "call again" in answer and "\n" not in answer
