"""A two-member group on two daemons, each in a network namespace of its own (pyroute2), driven
by ``ckptd.client``: a member's dump failing leaves both members running and nothing listed;
a good group checkpoint is recorded on both daemons and restored as a whole, each member's
output going on bit for bit."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.client import Daemon as Client
from ckptd.client import GroupError, group_checkpoint, group_restore

from .netns import Node, TwoNodes, in_netns
from .support import (
    Daemon,
    Procs,
    assert_held,
    assert_ok,
    assert_running,
    is_alive,
    manifest_keys_of,
    proc_state,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 150
INTERVAL = 30


@pytest.fixture
def nodes() -> Iterator[TwoNodes]:
    with TwoNodes() as pair:
        yield pair


def start_rank(procs: Procs, node: Node, out: Path, rank: int) -> tuple[int, list[str]]:
    cmd = workload("counter", "--steps", STEPS + rank, "--mem-mib", 8)
    ref = reference(with_interval(cmd, 0))
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out, in_netns(node.name))
    wait_for_lines(out, 3)
    return pid, ref


@pytest.fixture
def daemons(
    start_daemon: Callable[..., Daemon], nodes: TwoNodes
) -> tuple[Daemon, Daemon]:
    a = start_daemon(config={"node": "node-a"}, preexec_fn=in_netns(nodes.a.name))
    b = start_daemon(config={"node": "node-b"}, preexec_fn=in_netns(nodes.b.name))
    return a, b


def test_a_failing_member_aborts_the_group_both_keep_running_nothing_listed(
    daemons: tuple[Daemon, Daemon], nodes: TwoNodes, procs: Procs, tmp_path: Path
) -> None:
    """Rank 1 writes to a Unix socket whose other end is outside its tree (held by this
    test): CRIU refuses it after freezing it, while rank 0 is already dumped and held."""
    a, b = daemons
    pid_a, _ = start_rank(procs, nodes.a, tmp_path / "r0.out", 0)
    outside, inside = socket.socketpair()
    try:
        rank1 = procs.popen(
            with_interval(workload("counter", "--steps", 100_000), INTERVAL),
            stdin=subprocess.DEVNULL, stdout=inside.fileno(), stderr=subprocess.DEVNULL,
            preexec_fn=in_netns(nodes.b.name),
        )
        inside.close()
        outside.recv(64)
        with Client(str(a.socket)) as ca, Client(str(b.socket)) as cb:
            with pytest.raises(GroupError, match="every member resumed") as info:
                group_checkpoint([(ca, pid_a), (cb, rank1.pid)], name="bad")
            assert f"pid {rank1.pid}" in str(info.value)
            assert f"CRIU dump of pid {rank1.pid} failed" in str(info.value), "CRIU refused"
            assert ca.list_groups() == [] and cb.list_groups() == []
        for pid in (pid_a, rank1.pid):
            assert_running(pid, "after an aborted group checkpoint")
            assert proc_state(pid) not in ("T", "t")
        outside.recv(64)  # rank 1 writes on: it runs
        assert assert_ok(a.ctl("list"), "list a") == []
        assert assert_ok(b.ctl("list"), "list b") == []
    finally:
        outside.close()


def test_a_group_is_checkpointed_recorded_and_restored_as_a_whole(
    daemons: tuple[Daemon, Daemon], nodes: TwoNodes, procs: Procs, tmp_path: Path
) -> None:
    a, b = daemons
    out0, out1 = tmp_path / "r0.out", tmp_path / "r1.out"
    pid_a, ref0 = start_rank(procs, nodes.a, out0, 0)
    pid_b, ref1 = start_rank(procs, nodes.b, out1, 1)
    with Client(str(a.socket)) as ca, Client(str(b.socket)) as cb:
        group = group_checkpoint([(ca, pid_a), (cb, pid_b)], name="llm")
        assert [m.node for m in group.members] == ["node-a", "node-b"]
        assert not is_alive(pid_a) and not is_alive(pid_b)
        for client in (ca, cb):
            listed = client.list_groups()
            assert [g.id for g in listed] == [group.id]
            assert listed[0].members == group.members
        labels = {c.id: dict(c.labels) for c in ca.checkpoints() + cb.checkpoints()}
        assert all(lab.get("group") == group.id for lab in labels.values())

        pids = group_restore(group, [ca, cb])
    assert sorted(pids.values()) == sorted([pid_a, pid_b])
    for pid in pids.values():
        procs.add(pid)
    assert wait_for_done(out0) == ref0
    assert wait_for_done(out1) == ref1


COORDINATOR = """
import json, sys
from pathlib import Path
from ckptd.client import Daemon, group_checkpoint, group_restore
from ckptd.transport.grpc.peer import TlsFiles
cert, key, ca, addr_a, pid_a, addr_b, pid_b = sys.argv[1:8]
tls = TlsFiles(Path(cert), Path(key), Path(ca))
a, b = Daemon(addr_a, tls=tls), Daemon(addr_b, tls=tls)
group = group_checkpoint([(a, int(pid_a)), (b, int(pid_b))], name="remote")
listed = [g.id for g in b.list_groups()]
pids = group_restore(group, [a, b])
print(json.dumps({"group": group.id, "listed_on_b": listed, "pids": sorted(pids.values())}))
"""


def test_a_coordinator_on_another_node_drives_the_group_over_mutual_tls(
    start_daemon: Callable[..., Daemon], nodes: TwoNodes, procs: Procs, tmp_path: Path
) -> None:
    import json
    import sys

    from .certs import make_ca, make_node_cert

    ca = make_ca(tmp_path / "ca")
    flags = {}
    for name, node in (("a", nodes.a), ("b", nodes.b)):
        cert, key = make_node_cert(tmp_path / "ca", tmp_path / "certs", name, [node.address])
        flags[name] = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca),
                       "--peer-listen", f"{node.address}:7443"]
    start_daemon(*flags["a"], preexec_fn=in_netns(nodes.a.name))
    start_daemon(*flags["b"], preexec_fn=in_netns(nodes.b.name))
    coord_cert, coord_key = make_node_cert(tmp_path / "ca", tmp_path / "certs", "coordinator",
                                           [nodes.a.address])
    out0, out1 = tmp_path / "r0.out", tmp_path / "r1.out"
    pid_a, ref0 = start_rank(procs, nodes.a, out0, 0)
    pid_b, ref1 = start_rank(procs, nodes.b, out1, 1)
    run = subprocess.run(
        [sys.executable, "-c", COORDINATOR, str(coord_cert), str(coord_key), str(ca),
         f"{nodes.a.address}:7443", str(pid_a), f"{nodes.b.address}:7443", str(pid_b)],
        capture_output=True, text=True, timeout=120, check=False,
        preexec_fn=in_netns(nodes.a.name),
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["listed_on_b"] == [result["group"]]
    assert result["pids"] == sorted([pid_a, pid_b])
    for pid in result["pids"]:
        procs.add(pid)
    assert wait_for_done(out0) == ref0
    assert wait_for_done(out1) == ref1


def test_a_daemon_killed_while_holding_a_member_resumes_it_at_restart(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    """Never hurt the workload: a member held (stopped, nothing committed) by a daemon that is
    SIGKILLed runs again once the daemon starts again, and nothing is listed."""
    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb

    from .conftest import criu_path

    d = Daemon(tmp_path / "killed", "--criu", str(criu_path()))  # not the fixture's: killed
    out = tmp_path / "r0.out"
    cmd = workload("counter", "--steps", STEPS, "--mem-mib", 8)
    ref = reference(with_interval(cmd, 0))
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out)
    wait_for_lines(out, 3)
    with Client(str(d.socket)) as client:
        client.stub.GroupPrepare(pb.GroupPrepareRequest(group_id="g-kill", pid=pid,
                                                        timeout_s=300), timeout=60)
    assert_held(pid)
    d.proc.kill()
    d.proc.wait()
    again = start_daemon("--store", str(d.store), "--state-dir", str(d.state_dir),
                         "--manifest-keys", str(manifest_keys_of(d.root)))  # d's key
    assert_running(pid, "resumed by the restarted daemon's recovery")
    assert proc_state(pid) not in ("T", "t")
    assert assert_ok(again.ctl("list"), "list") == []
    assert wait_for_done(out) == ref


def test_a_daemon_killed_while_holding_a_restored_member_kills_it_at_restart(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path
) -> None:
    """A group restore held (stopped, never let run) by a daemon that is SIGKILLed: the next
    start kills the held tree instead of leaving it stopped forever; the checkpoint stays."""
    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb

    from .conftest import criu_path

    d = Daemon(tmp_path / "killed", "--criu", str(criu_path()))  # not the fixture's: killed
    out = tmp_path / "r0.out"
    cmd = workload("counter", "--steps", 100_000, "--mem-mib", 8)
    pid = start_detached(procs, with_interval(cmd, INTERVAL), out)
    wait_for_lines(out, 3)
    ck = assert_ok(d.ctl("dump", pid), "dump")["id"]
    with Client(str(d.socket)) as client:
        held = client.stub.GroupPrepareRestore(pb.GroupPrepareRestoreRequest(
            group_id="r-kill", checkpoint_id=ck, timeout_s=300), timeout=60)
    procs.add(held.pid)
    assert_held(held.pid)
    d.proc.kill()
    d.proc.wait()
    again = start_daemon("--store", str(d.store), "--state-dir", str(d.state_dir),
                         "--manifest-keys", str(manifest_keys_of(d.root)))  # d's key
    wait_until(lambda: not is_alive(held.pid), 10, "the held tree to be killed at start")
    assert [c["id"] for c in assert_ok(again.ctl("list"), "list")] == [ck]
