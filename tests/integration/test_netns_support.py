"""Checks of the two-node test helpers: ``netns.TwoNodes`` / ``netns.in_netns`` and ``certs``.

- a ``counter --port`` in namespace ``a`` answers a client in namespace ``b`` over the veth,
  and ``in_netns`` changed the child's network namespace and nothing else (CRIU needs the
  task in its own mount namespace);
- certificates from ``certs`` give working mutual TLS with gRPC, and a client certificate
  from another CA, a self-signed one, or none at all is refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .certs import make_ca, make_node_cert, make_self_signed
from .netns import TwoNodes, in_netns, netns_path
from .support import Procs, workload

pytestmark = pytest.mark.integration

PORT = 47001
RPC_TIMEOUT_S = 10.0

# Runs in namespace b: print its own mount and network namespaces (one line), connect to
# argv[1]:argv[2] (retrying until the listener is up) and print everything the server sends.
CLIENT = """
import os, socket, sys, time
print(os.readlink("/proc/self/ns/mnt"), os.readlink("/proc/self/ns/net"), flush=True)
deadline = time.monotonic() + 20
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
with conn:
    sys.stdout.write(conn.makefile().read())
"""


def ns_link(pid: int | str, kind: str) -> str:
    """``/proc/PID/ns/KIND`` as its link text, e.g. ``net:[4026531840]``."""
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def netns_link(name: str) -> str:
    """What ``/proc/PID/ns/net`` reads as for a process in the named namespace ``name``."""
    return f"net:[{os.stat(netns_path(name)).st_ino}]"


def test_counter_in_one_namespace_serves_a_client_in_the_other(
    workloads: Path, procs: Procs
) -> None:
    """counter --port in a; a client in b reads its state line over the veth."""
    del workloads
    with TwoNodes() as nodes:
        server = procs.popen(
            workload("counter", "--steps", 600, "--interval-ms", 50, "--port", PORT),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=in_netns(nodes.a.name), start_new_session=True,
        )
        client = procs.popen(
            [sys.executable, "-c", CLIENT, nodes.a.address, str(PORT)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=in_netns(nodes.b.name), start_new_session=True,
        )
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, f"client in {nodes.b} failed: {err}"
        parsed = re.fullmatch(r"(\S+) (\S+)\n(.*)", out, re.S)
        assert parsed, f"unexpected client output: {out!r}"
        client_mnt, client_net, answer = parsed.groups()
        match = re.fullmatch(r"counter step (\d+) ([0-9a-f]{16})\n", answer)
        assert match, f"unexpected answer from counter at {nodes.a}: {out!r}"

        # The line carries the state of a step that stdout reports too.
        want = f"step {match[1]} {match[2]}"
        assert server.stdout is not None
        seen = []
        for line in server.stdout:
            seen.append(line.rstrip("\n"))
            if seen[-1] == want or len(seen) >= int(match[1]):
                break
        assert seen[-1] == want, f"{want!r} not on counter's stdout; last lines: {seen[-3:]}"

        # Only the network namespace changed: CRIU needs the task in its own mount namespace.
        # (The client has exited: it reported its own namespaces.)
        assert ns_link(server.pid, "mnt") == ns_link("self", "mnt") == client_mnt
        assert ns_link(server.pid, "pid") == ns_link("self", "pid")
        assert ns_link(server.pid, "net") == netns_link(nodes.a.name)
        assert client_net == netns_link(nodes.b.name)
        assert len({ns_link("self", "net"), ns_link(server.pid, "net"), client_net}) == 3
        assert server.poll() is None, "counter should still be running"
        names = (nodes.a.name, nodes.b.name)
    for name in names:
        assert not os.path.exists(netns_path(name)), f"{name} not removed"


def _health_check(port: int, credentials: grpc.ChannelCredentials) -> object:
    """Health ``Check`` of the server; the status, or the ``grpc.StatusCode`` it failed with."""
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code()
        return reply.status


def test_certs_give_mutual_tls_and_refuse_other_clients(tmp_path: Path) -> None:
    """Same-CA client: SERVING; other-CA, self-signed or no client certificate: UNAVAILABLE."""
    ca_dir, other_dir, out = tmp_path / "ca", tmp_path / "other-ca", tmp_path / "certs"
    ca_pem = make_ca(ca_dir)
    make_ca(other_dir)
    server_cert, server_key = make_node_cert(ca_dir, out, "server", ["127.0.0.1"])
    client_cert, client_key = make_node_cert(ca_dir, out, "client", ["127.0.0.1"])
    alien_cert, alien_key = make_node_cert(other_dir, out, "alien", ["127.0.0.1"])
    self_cert, self_key = make_self_signed(out, "selfie", ["127.0.0.1"])
    ca = ca_pem.read_bytes()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(server_key.read_bytes(), server_cert.read_bytes())],
            root_certificates=ca, require_client_auth=True,
        ),
    )
    assert port > 0
    server.start()
    try:

        def with_cert(cert: Path, key: Path) -> grpc.ChannelCredentials:
            return grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key.read_bytes(),
                certificate_chain=cert.read_bytes(),
            )

        serving = health_pb2.HealthCheckResponse.SERVING
        assert _health_check(port, with_cert(client_cert, client_key)) == serving
        unavailable = grpc.StatusCode.UNAVAILABLE
        assert _health_check(port, with_cert(alien_cert, alien_key)) == unavailable
        assert _health_check(port, with_cert(self_cert, self_key)) == unavailable
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        assert _health_check(port, no_cert) == unavailable
        # The server itself is fine after refusing those: the good client still gets in.
        assert _health_check(port, with_cert(client_cert, client_key)) == serving
    finally:
        server.stop(grace=None).wait(timeout=10)
