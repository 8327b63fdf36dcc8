"""Connections to services outside the job (issue 24, point 2): a job talking TCP to a server
that is not checkpointed with it (a metrics server, a parameter store, a database) is dumped
without --tcp-close, and restored with the connection **established** where the node has the
connection's local address: on the same node the server is still there, and the job goes on
talking to it exactly as an uninterrupted run. Restored where that address is missing (a
migration to a node that does not have it), the tree's connections come back closed and the
restore's event names them; ``check-restore`` says which beforehand."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .certs import make_ca, make_node_cert
from .netns import TwoNodes, in_netns
from .support import Daemon, Procs, assert_ok, proc_state, start_detached, wait_until

pytestmark = pytest.mark.integration

PAIR = Path(__file__).parent / "jobs" / "tcp_pair.py"
STEPS = 20
PEER_PORT = 7443
SERVER = """
import hashlib, socket, sys, threading
server = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], 0))
server.listen(4)
print(server.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        while data := conn.recv(32, socket.MSG_WAITALL):
            conn.sendall(hashlib.sha256(b"server" + data).digest())
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def _server(procs: Procs, host: str, preexec_fn: Callable[[], None] | None = None) -> int:
    """A server outside any checkpointed tree (answers as tcp_pair's own); its port."""
    proc = procs.popen([sys.executable, "-c", SERVER, host], stdout=subprocess.PIPE,
                       stdin=subprocess.DEVNULL, text=True, preexec_fn=preexec_fn)
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def _job(procs: Procs, out: Path, interval_ms: int, *extra: str,
         preexec_fn: Callable[[], None] | None = None) -> int:
    return start_detached(procs, [sys.executable, PAIR, STEPS, interval_ms, *extra], out,
                          preexec_fn)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _events(daemon: Daemon) -> list[dict[str, object]]:
    res = daemon.ctl("events", "--last", "200")
    assert res.rc == 0, res.err
    text = res.out if isinstance(res.out, str) else json.dumps(res.out)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_connection_to_a_server_outside_the_job_is_restored_established_on_the_same_node(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    ref = tmp_path / "ref.txt"
    _job(procs, ref, 0)  # its own server in the tree answers the same
    wait_until(lambda: ref.exists() and _lines(ref)[-1:] == ["done"], 60, "the reference run")
    port = _server(procs, "127.0.0.1")
    out = tmp_path / "out.txt"
    pid = _job(procs, out, 150, "--peer", f"127.0.0.1:{port}")
    wait_until(lambda: out.exists() and len(_lines(out)) >= 3, 30, "3 steps")
    ck = assert_ok(daemon.ctl("dump", pid), "dump (no --tcp-close)")
    assert ck["tcp_connections"] == 1 and not ck.get("tcp_close")
    wait_until(lambda: proc_state(pid) in (None, "Z"), 10, "the dumped job to die")
    report = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore")
    (note,) = [n for n in report["notes"] if "TCP" in n]
    assert "1 TCP connection(s) established" in note and f"127.0.0.1:{port} (" in note
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: _lines(out)[-1:] == ["done"], 60, "the restored job to finish")
    assert out.read_bytes() == ref.read_bytes()  # it went on talking to the same server
    done = [e for e in _events(daemon) if e["kind"] == "restore.done"
            and e.get("checkpoint_id") == ck["id"]]
    assert done and "closed" not in str(done[-1]["message"])


@pytest.fixture
def nodes() -> Iterator[TwoNodes]:
    with TwoNodes() as pair:
        yield pair


def test_restored_where_the_connection_s_address_is_missing_it_comes_back_closed_with_an_event(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, nodes: TwoNodes
) -> None:
    ca_dir = tmp_path / "ca"
    ca = make_ca(ca_dir)
    daemons = []
    for name, node in (("a", nodes.a), ("b", nodes.b)):
        cert, key = make_node_cert(ca_dir, tmp_path / "certs", name, [node.address])
        daemons.append(start_daemon(
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca),
            "--peer-listen", f"{node.address}:{PEER_PORT}",
            config={"node": f"node-{name}", "gc_grace_s": 0}, preexec_fn=in_netns(node.name),
        ))
    a, b = daemons
    port = _server(procs, nodes.a.address, preexec_fn=in_netns(nodes.a.name))
    out = tmp_path / "out.txt"
    pid = _job(procs, out, 150, "--peer", f"{nodes.a.address}:{port}",
               preexec_fn=in_netns(nodes.a.name))
    wait_until(lambda: out.exists() and len(_lines(out)) >= 3, 30, "3 steps")
    ck = assert_ok(a.ctl("dump", pid, "--leave-running"), "dump on a")
    assert ck["tcp_connections"] == 1
    report = assert_ok(a.ctl("check-restore", ck["id"]), "check-restore on a")
    assert any("established" in n for n in report["notes"] if "TCP" in n)
    res = assert_ok(a.ctl("migrate", pid, "--to", f"{nodes.b.address}:{PEER_PORT}"),
                    "migrate to b")
    procs.add(res["pid"])
    listed = assert_ok(b.ctl("list"), "list on b")
    rows = listed if isinstance(listed, list) else listed.get("checkpoints", [])
    on_b = [r["id"] for r in rows if r["pid"] == pid]
    assert on_b, listed
    report = assert_ok(b.ctl("check-restore", on_b[-1]), "check-restore on b")
    (note,) = [n for n in report["notes"] if "TCP" in n]
    assert "closed, not established" in note and f"{nodes.a.address}:" in note, note
    done = [e for e in _events(b) if e["kind"] == "restore.done"]
    assert done, "b's restore.done event"
    message = str(done[-1]["message"])
    assert "TCP connection(s) restored closed" in message, message
    assert f"{nodes.a.address}:" in message and f"{nodes.a.address}:{port}" in message, message
