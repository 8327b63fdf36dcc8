"""``ProcFsTable.tcp_connections`` on real sockets, and the /proc/net/tcp address format."""

from __future__ import annotations

import os
import socket

from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.adapters.procfs.tcp import _address


def test_kernel_addresses_are_read_as_ip_and_port() -> None:
    assert _address("0100007F:1F90") == "127.0.0.1:8080"
    assert _address("00000000000000000000000001000000:0016") == "[::1]:22"
    assert _address("0000000000000000FFFF00000100007F:0050") == "127.0.0.1:80"


def test_a_connected_pair_is_seen_from_both_ends_and_a_listener_is_not() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        table = ProcFsTable()
        me = next(p for p in table.tree(os.getpid()) if p.pid == os.getpid())
        conns = table.tcp_connections((me,))
        ends = {(c.local, c.remote) for c in conns}
        a = f"127.0.0.1:{client.getsockname()[1]}"
        b = f"127.0.0.1:{server.getsockname()[1]}"
        assert {(a, b), (b, a)} <= ends
        assert all(c.state == "ESTABLISHED" and c.pid == os.getpid() for c in conns)
        assert not any(c.local == b and c.remote.endswith(":0") for c in conns)
    finally:
        for s in (client, accepted, server):
            s.close()
