"""Established TCP connections inside the tree are checkpointed and restored (CRIU's
tcp-established, the network locked with nftables meanwhile), and the job continues bit for
bit; with ``tcp_outside_peers = "refuse"`` a connection to a peer outside the tree is refused
before anything is frozen, naming the peer and the process, unless the dump says --tcp-close
(by default it is dumped and restored: tests/integration/test_tcp_outside.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .flows import TCP_PAIR as PAIR
from .flows import criu_tables as _criu_tables
from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    proc_state,
    wait_until,
)

pytestmark = pytest.mark.integration

STEPS = 25


def _start(procs: Procs, out: Path, *extra: str, interval_ms: int = 100) -> int:
    with open(out, "wb") as stdout:
        proc = procs.popen(
            [sys.executable, str(PAIR), str(STEPS), str(interval_ms), *extra],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return proc.pid


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_tree_talking_tcp_to_itself_is_checkpointed_and_continues_exactly(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    tables_before = set(_criu_tables())
    ref = tmp_path / "ref.txt"
    pid = _start(procs, ref, interval_ms=0)
    wait_until(lambda: _lines(ref)[-1:] == ["done"], 60, "the reference run")
    out = tmp_path / "out.txt"
    pid = _start(procs, out)
    wait_until(lambda: len(_lines(out)) >= 5, 30, "5 steps")
    ck = assert_ok(daemon.ctl("dump", pid), "dump")
    assert ck["tcp_connections"] == 2 and not ck.get("tcp_close")
    wait_until(lambda: proc_state(pid) in (None, "Z"), 10, "the dumped job to die")
    procs.cleanup()
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: _lines(out)[-1:] == ["done"], 60, "the restored job to finish")
    assert out.read_bytes() == ref.read_bytes()
    assert set(_criu_tables()) - tables_before == set()  # the restore unlocked the network


class _Server:
    """A peer outside the tree: answers like the tree's own server."""

    def __init__(self) -> None:
        import hashlib

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]

        def serve() -> None:
            conn, _ = self.sock.accept()
            with conn:
                while data := conn.recv(32, socket.MSG_WAITALL):
                    conn.sendall(hashlib.sha256(b"server" + data).digest())

        threading.Thread(target=serve, daemon=True).start()


def test_a_connection_to_a_peer_outside_the_tree_is_refused_unless_tcp_close(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    """Where the user asks for it (``tcp_outside_peers = "refuse"``)."""
    daemon = start_daemon(config={"tcp_outside_peers": "refuse"})
    tables_before = set(_criu_tables())
    server = _Server()
    out = tmp_path / "out.txt"
    pid = _start(procs, out, "--peer", f"127.0.0.1:{server.port}", interval_ms=200)
    wait_until(lambda: len(_lines(out)) >= 2, 30, "2 steps")
    res = daemon.ctl("dump", pid)
    line = assert_one_line_error(res, res.rc, f"127.0.0.1:{server.port}", "outside the tree",
                                 "--tcp-close")
    assert "python" in line
    time.sleep(0.3)
    assert proc_state(pid) not in ("T", "t", None)  # nothing was frozen
    seen = len(_lines(out))
    wait_until(lambda: len(_lines(out)) > seen, 10, "the job to go on")
    ck = assert_ok(daemon.ctl("dump", pid, "--leave-running", "--tcp-close"),
                   "dump --tcp-close")
    assert ck["tcp_connections"] >= 1 and ck["tcp_close"] is True
    seen = len(_lines(out))
    wait_until(lambda: len(_lines(out)) > seen, 10, "the job to go on after the dump")
    assert set(_criu_tables()) - tables_before == set()  # the network was unlocked


LISTENER = Path(__file__).parent / "jobs" / "listener.py"


def test_a_listening_socket_with_a_connection_not_yet_accepted_is_checkpointed(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """Issue 34 (7), zdtm ``socket-tcp-skip-in-flight``: a client's connection waits in a
    listening socket's queue (connect() has returned: the kernel completed the handshake, the
    job has not accepted it). The dump takes the listener without it (CRIU's
    tcp_skip_in_flight, always set), the job's output continues exactly, and the restored
    server accepts and answers new clients on the same port."""
    port_file, gate, out = tmp_path / "port", tmp_path / "gate", tmp_path / "out.txt"
    with open(out, "wb") as stdout:
        pid = procs.popen([sys.executable, str(LISTENER), str(port_file), str(gate)],
                          stdin=subprocess.DEVNULL, stdout=stdout,
                          stderr=subprocess.DEVNULL, start_new_session=True).pid
    wait_until(port_file.exists, 30, "the server to listen")
    port = int(port_file.read_text())
    waiting = socket.create_connection(("127.0.0.1", port), timeout=10)  # in the queue now
    try:
        wait_until(lambda: len(_lines(out)) >= 3, 30, "3 steps")
        ck = assert_ok(daemon.ctl("dump", pid), "dump")
        wait_until(lambda: proc_state(pid) in (None, "Z"), 10, "the dumped job to die")
        procs.cleanup()
        dumped_at = len(_lines(out))
        res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
        procs.add(res["pid"])
        assert res["pid"] == pid
        wait_until(lambda: len(_lines(out)) >= dumped_at + 3, 30, "the restored job's steps")
        gate.touch()
        wait_until(lambda: "accepting" in _lines(out), 30, "the restored server to accept")
        lines = _lines(out)
        assert lines[:-1] == [str(i) for i in range(len(lines) - 1)], "no step lost or twice"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"after-restore")
            assert client.recv(64) == b"echo:after-restore"
    finally:
        waiting.close()
