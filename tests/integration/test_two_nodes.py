"""Two nodes on one machine: two daemons, each in a network namespace of its own joined by a
veth pair (made with pyroute2), each with its own store. A stateful job listening on TCP is
started in A, migrated to B (it answers on B's address, from B's network namespace, and its
computation goes on), then back to A: that second transfer is at most 1.5x the bytes of the
pages that changed in between. The same scenario through one shared S3 bucket (moto's server,
in namespace A) sends no pages at all. The job's whole output equals an uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from contract.moto_server import CREDENTIALS, REGION, MotoServer, moto_missing

from ckptd.adapters.storage import LocalBlobStore, keyfile
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.pagehash import PAGE_SIZE, ZERO_REF
from ckptd.testing import FakeClock

from .certs import make_ca, make_node_cert
from .netns import Node, TwoNodes, in_netns, netns_path
from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_running,
    manifest_keys_of,
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

PEER_PORT = 7443
JOB_PORT = 27100
"""Below the ephemeral range (32768-60999): in 47100's time a client socket of node a (a
daemon's keep-alive connection to the S3 server there) could hold the port when the job
came back, and CRIU could not bind its listening socket (Address already in use)."""
STEPS = 260
INTERVAL = 20
MEM_MIB = 24


@pytest.fixture
def nodes() -> Iterator[TwoNodes]:
    with TwoNodes() as pair:
        yield pair


def ask(node: Node, address: str, port: int) -> str:
    """Connect from inside ``node``'s namespace to ``address:port``; the line it answered."""
    script = (
        "import socket,sys\n"
        "s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5)\n"
        "print(s.makefile().readline().strip())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, address, str(port)], capture_output=True, text=True,
        timeout=20, check=True, preexec_fn=in_netns(node.name),
    )
    return out.stdout.strip()


def step_answered(line: str) -> int:
    prog, word, step, _hash = line.split()
    assert (prog, word) == ("counter", "step"), line
    return int(step)


def net_ns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def start_nodes(
    start_daemon: Callable[..., Daemon], nodes: TwoNodes, tmp_path: Path, *store_flags: str,
    env: dict[str, str] | None = None,
) -> tuple[Daemon, Daemon]:
    ca_dir = tmp_path / "ca"
    ca = make_ca(ca_dir)
    daemons = []
    for name, node in (("a", nodes.a), ("b", nodes.b)):
        cert, key = make_node_cert(ca_dir, tmp_path / "certs", name, [node.address])
        daemons.append(start_daemon(
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca),
            "--peer-listen", f"{node.address}:{PEER_PORT}", *store_flags,
            config={"node": f"node-{name}", "gc_grace_s": 0},
            preexec_fn=in_netns(node.name), env=env,
        ))
    return daemons[0], daemons[1]


def start_job(procs: Procs, node: Node, out_path: Path) -> tuple[int, list[str]]:
    cmd = workload("counter", "--steps", STEPS, "--mem-mib", MEM_MIB, "--port", JOB_PORT)
    ref = reference(with_interval(workload("counter", "--steps", STEPS, "--mem-mib", MEM_MIB),
                                  0))
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out_path, in_netns(node.name))
    wait_for_lines(out_path, 4)
    return pid, ref


def distinct_new_pages(store_root: Path, old: str, new: str) -> int:
    """Distinct non-zero pages of checkpoint ``new`` that checkpoint ``old`` lacks."""
    keys, _ = keyfile.load_or_create(manifest_keys_of(store_root.parent))
    store = ContentStore(
        LocalBlobStore(store_root), StagingPolicy(fast=None, disk=store_root / "x"),
        clock=FakeClock(), is_pages_file=lambda n: n.startswith("pages-"), keys=keys,
    )
    def pages(ck: str) -> set[bytes]:
        return {r for refs in store.page_refs(ck).values() for r in refs if r != ZERO_REF}
    return len(pages(new) - pages(old))


def migrate_and_check(
    src: Daemon, dst: Daemon, pid: int, dst_node: Node, other: Node, procs: Procs,
) -> dict[str, Any]:
    res = assert_ok(src.ctl("migrate", pid, "--to", f"{dst_node.address}:{PEER_PORT}"),
                    "migrate")
    procs.add(res["pid"])
    assert res["pid"] == pid
    assert_running(pid, f"on {dst_node.name}")
    assert net_ns_of(pid) == os.stat(netns_path(dst_node.name)).st_ino, \
        "the restored job must live in the target's network namespace"
    answered = step_answered(ask(other, dst_node.address, JOB_PORT))
    time.sleep(0.2)
    assert step_answered(ask(other, dst_node.address, JOB_PORT)) > answered, \
        "the job computes on at the target"
    return res


def test_a_listening_job_moves_to_b_and_back_and_the_return_sends_only_the_changes(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, nodes: TwoNodes,
) -> None:
    a, b = start_nodes(start_daemon, nodes, tmp_path)
    out_path = tmp_path / "job.out"
    pid, ref = start_job(procs, nodes.a, out_path)
    step_answered(ask(nodes.b, nodes.a.address, JOB_PORT))  # reachable from b, in a

    first = migrate_and_check(a, b, pid, nodes.b, nodes.a, procs)
    assert first["pages_sent"] == first["pages_total"] > MEM_MIB * 256
    wait_for_lines(out_path, len(read_lines_file(out_path)) + 20)  # it changes pages in b

    second = migrate_and_check(b, a, pid, nodes.a, nodes.b, procs)
    wait_until(lambda: second["checkpoint_id"] in
               [c["id"] for c in assert_ok(a.ctl("list"), "list on a")], 30,
               "a to commit the received checkpoint (in the background)")
    changed = distinct_new_pages(a.store, first["checkpoint_id"], second["checkpoint_id"])
    assert second["pages_sent"] == changed, (second, changed)
    assert second["bytes_sent"] <= 1.5 * changed * PAGE_SIZE, (second, changed)

    assert wait_for_done(out_path) == ref


@pytest.fixture
def moto_in_a(nodes: TwoNodes, tmp_path: Path) -> Iterator[MotoServer]:
    reason = moto_missing()
    if reason:
        pytest.skip(reason)
    server = MotoServer(tmp_path, host=nodes.a.address, preexec_fn=in_netns(nodes.a.name))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def make_bucket(node: Node, endpoint: str) -> str:
    """Create a bucket from inside ``node`` (the server is only reachable there)."""
    script = (
        "import sys,time,boto3\n"
        "c=boto3.client('s3',endpoint_url=sys.argv[1],region_name=sys.argv[2])\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        c.create_bucket(Bucket='shared'); break\n"
        "    except Exception:\n"
        "        time.sleep(0.2)\n"
        "else:\n"
        "    raise SystemExit('moto did not answer')\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, endpoint, REGION], check=True, timeout=60,
        env={**os.environ, **CREDENTIALS}, preexec_fn=in_netns(node.name),
    )
    return "shared"


def test_through_a_shared_bucket_no_pages_travel(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, nodes: TwoNodes,
    moto_in_a: MotoServer,
) -> None:
    bucket = make_bucket(nodes.a, moto_in_a.endpoint)
    env = {**os.environ, **CREDENTIALS, "AWS_REGION": REGION}
    flags = ["--store", f"s3://{bucket}/ckpt", "--store-endpoint", moto_in_a.endpoint,
             "--store-allow-http", "--store-region", REGION]
    a, b = start_nodes(start_daemon, nodes, tmp_path, *flags, env=env)
    out_path = tmp_path / "job.out"
    pid, ref = start_job(procs, nodes.a, out_path)

    first = migrate_and_check(a, b, pid, nodes.b, nodes.a, procs)
    assert first["shared_store"] and first["pages_sent"] == 0 and first["bytes_sent"] == 0
    wait_until(lambda: len(read_lines_file(out_path)) > 40, 20, "steps on b")
    second = migrate_and_check(b, a, pid, nodes.a, nodes.b, procs)
    assert second["shared_store"] and second["pages_sent"] == 0
    assert wait_for_done(out_path) == ref
