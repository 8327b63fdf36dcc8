"""``ckptctl migrate``: two daemons with their own stores talk gRPC over TCP with mutual TLS
(certificates from a CA this test creates). The job moves and continues exactly; a second
migration sends only the pages the target lacks; a failure after the checkpoint leaves the job
running here; a peer without a certificate of the CA is refused by the TLS handshake; the
listener is off unless configured."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from ckptd._gen.ckptd.v1 import peer_pb2, peer_pb2_grpc

from .certs import make_ca, make_node_cert
from .support import (
    REPO,
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    assert_running,
    free_pid,
    read_lines_file,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 160
INTERVAL = 25
MEM_MIB = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pki:
    """A CA and a certificate per node, made by the operators' tool,
    scripts/make-peer-certs.sh (openssl)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = root / "ca.pem"

    def flags(self, name: str, ips: list[str]) -> list[str]:
        subprocess.run(
            ["bash", str(REPO / "scripts" / "make-peer-certs.sh"), str(self.root),
             f"{name}={','.join(ips)}"],
            check=True, capture_output=True, timeout=60,
        )
        return ["--tls-cert", str(self.root / f"{name}.pem"),
                "--tls-key", str(self.root / f"{name}.key"), "--tls-ca", str(self.ca)]


def start_node(
    start_daemon: Callable[..., Daemon], pki: Pki, name: str, *extra: str
) -> tuple[Daemon, str]:
    address = f"127.0.0.1:{free_port()}"
    flags = [*pki.flags(name, ["127.0.0.1"]), "--peer-listen", address]
    return start_daemon(*flags, *extra, config={"node": name, "gc_grace_s": 0}), address


def start_job(procs: Procs, out_path: Path, steps: int = STEPS) -> tuple[int, list[str]]:
    """The counter, started by a shell that exits (as a launcher does): the job is nobody's
    child here, so nothing of the test holds its zombie when a migration kills it."""
    cmd = workload("counter", "--steps", steps, "--mem-mib", MEM_MIB)
    ref = reference(with_interval(cmd, 0)) if steps == STEPS else []
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out_path)
    wait_for_lines(out_path, 4)
    return pid, ref


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def test_a_job_migrates_there_and_back_and_continues_exactly(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, pki: Pki
) -> None:
    a, addr_a = start_node(start_daemon, pki, "node-a")
    b, addr_b = start_node(start_daemon, pki, "node-b")
    out_path = tmp_path / "job.out"
    pid, ref = start_job(procs, out_path)

    first = assert_ok(a.ctl("migrate", pid, "--to", addr_b), "migrate a->b")
    procs.add(first["pid"])
    assert first["node"] == "node-b" and first["address"] == addr_b
    assert first["pid"] == pid and not first["shared_store"]
    assert first["pages_total"] >= MEM_MIB * 256
    assert first["pages_sent"] == first["pages_total"], "b's store was empty"
    assert_running(pid, "after the first migration")
    # b restored it from the received images, and commits them in the background
    wait_until(lambda: [c["id"] for c in assert_ok(b.ctl("list"), "list on b")]
               == [first["checkpoint_id"]], 30, "b to commit the received checkpoint")
    wait_for_lines(out_path, len(read_lines_file(out_path)) + 3)

    second = assert_ok(b.ctl("migrate", pid, "--to", addr_a), "migrate b->a")
    procs.add(second["pid"])
    assert second["node"] == "node-a" and second["pid"] == pid
    # a holds the first checkpoint's pages: only what changed since travels back
    assert 0 < second["pages_sent"] < second["pages_total"] // 4, second
    assert second["bytes_sent"] < first["bytes_sent"] // 4, (first, second)

    lines = wait_for_done(out_path)
    assert lines == ref, "the job's whole output must equal an uninterrupted run's"


def test_a_target_that_cannot_restore_refuses_before_the_job_is_touched(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, pki: Pki
) -> None:
    a, _ = start_node(start_daemon, pki, "node-a")
    _b, addr_b = start_node(start_daemon, pki, "node-b", "--criu", "/nonexistent/criu")
    pid, _ref = start_job(procs, tmp_path / "job.out", steps=100_000)
    refused = a.ctl("migrate", pid, "--to", addr_b)
    line = assert_one_line_error(
        refused, 2, f"node node-b ({addr_b}) cannot restore pid {pid}", "CRIU",
        "nothing was touched",
    )
    assert "--ignore-warnings" not in line, "a blocking difference cannot be overridden"
    assert_running(pid, "after a refused migration")
    assert assert_ok(a.ctl("list"), "list") == [], "a refused migration dumps nothing"


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A tmpfs for a store, and a function that makes it read-only (even for root)."""
    mnt = tmp_path / "ro-store"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)

    def freeze() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    try:
        yield mnt, freeze
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_failure_after_the_checkpoint_restores_the_job_here(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, pki: Pki,
    read_only_store: tuple[Path, Callable[[], None]],
) -> None:
    a, _ = start_node(start_daemon, pki, "node-a")
    store, freeze = read_only_store
    _b, addr_b = start_node(
        start_daemon, pki, "node-b", "--store", str(store), "--state-dir",
        str(tmp_path / "b-state"),
    )
    out_path = tmp_path / "job.out"
    pid, ref = start_job(procs, out_path)
    freeze()  # b probes fine, but cannot take the checkpoint into its store
    failed = a.ctl("migrate", pid, "--to", addr_b)
    assert failed.rc == 1 and failed.out == "", failed
    assert len(failed.err.splitlines()) == 1, failed.err
    assert "the tree was restored on this node as pid" in failed.err, failed.err
    assert "Read-only file system" in failed.err or "read-only" in failed.err.lower()
    assert_running(pid, "restored here after the target failed")
    listed = assert_ok(a.ctl("list"), "list")
    assert len(listed) == 1, "the checkpoint it was restored from stays here"
    assert wait_for_done(out_path) == ref


def test_the_peer_listener_refuses_clients_without_a_certificate_of_its_ca(
    start_daemon: Callable[..., Daemon], tmp_path: Path, pki: Pki
) -> None:
    _b, addr_b = start_node(start_daemon, pki, "node-b")
    other = make_ca(tmp_path / "other-ca")
    cert, key = make_node_cert(tmp_path / "other-ca", tmp_path / "other", "x", ["127.0.0.1"])
    ca = pki.ca.read_bytes()
    cases = {
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "a certificate of another CA": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key.read_bytes(),
            certificate_chain=cert.read_bytes(),
        ),
    }
    assert other.exists()
    for what, creds in cases.items():
        with grpc.secure_channel(addr_b, creds) as channel:
            stub = peer_pb2_grpc.PeerStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as info:
                stub.Probe(peer_pb2.ProbeRequest(record_json=b"{}"), timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE, what


def test_without_peer_listen_there_is_no_tcp_listener_and_migrate_says_why(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, pki: Pki
) -> None:
    plain = start_daemon()
    listening = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
    inodes = {os.stat(f"/proc/{plain.pid}/fd/{fd}").st_ino
              for fd in os.listdir(f"/proc/{plain.pid}/fd")
              if os.readlink(f"/proc/{plain.pid}/fd/{fd}").startswith("socket:")}
    tcp_inodes = {int(line.split()[9]) for line in listening.splitlines()[1:]
                  if line.split()[3] == "0A"}
    assert not inodes & tcp_inodes, "a daemon without peer_listen must not listen on TCP"

    out_path = tmp_path / "job.out"
    pid, _ref = start_job(procs, out_path, steps=100_000)
    res = plain.ctl("migrate", pid, "--to", f"127.0.0.1:{free_port()}")
    assert_one_line_error(res, 1, "no TLS certificate", "tls_cert")
    assert_running(pid, "after a refused migration")

    unreachable = start_daemon(*pki.flags("node-a", ["127.0.0.1"]))
    res = unreachable.ctl("migrate", pid, "--to", f"127.0.0.1:{free_port()}")
    assert_one_line_error(res, 1, "cannot reach the ckptd peer listener")
    assert_running(pid, "after a failed migration")


@pytest.mark.parametrize("target", ["pid 1", "no such pid"])
def test_a_local_refusal_does_not_wait_for_the_peer(
    start_daemon: Callable[..., Daemon], pki: Pki, target: str
) -> None:
    """Issue 21 (11g): refused here at once, not after CONNECT_TIMEOUT_S spent on a target
    that does not answer (192.0.2.1: TEST-NET-1, never routed)."""
    d = start_daemon(*pki.flags("node-a", ["127.0.0.1"]))
    pid = 1 if target == "pid 1" else free_pid()
    started = time.monotonic()
    res = d.ctl("migrate", pid, "--to", "192.0.2.1:7443")
    took = time.monotonic() - started
    assert_one_line_error(res, 2, f"pid {pid}")
    assert "cannot reach" not in res.err, res.err
    assert took < 2.0, f"refused after {took:.1f}s: {res.err.strip()}"


def test_two_daemons_with_sockets_in_one_directory_each_serve_their_own(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    one = start_daemon(socket_dir=run, socket_name="one.sock", config={"node": "one"})
    two = start_daemon(socket_dir=run, socket_name="two.sock", config={"node": "two"})
    assert assert_ok(one.ctl("check"), "check one")["node"] == "one"
    assert assert_ok(two.ctl("check"), "check two")["node"] == "two"


def test_a_daemon_whose_socket_directory_is_long_still_serves(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The relay's per-caller sockets must fit sun_path (108 bytes) whatever the socket dir."""
    run = tmp_path / ("r" * (100 - len(str(tmp_path)) - len("/ckptd.sock")))
    d = start_daemon(socket_dir=run, config={"node": "long"})
    assert len(str(d.socket)) <= 107
    assert assert_ok(d.ctl("check"), "check")["node"] == "long"
