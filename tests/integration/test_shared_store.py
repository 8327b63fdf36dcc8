"""Two daemons on one object store (S3 API: moto's server on loopback).

Daemon A dumps a job (killing it); daemon B, which never saw the job, lists the checkpoint,
restores it and its output goes on bit for bit; B dumps the restored job again, deduplicating
against A's pages; A restores that one and the output still goes on; ``verify`` through B is
clean, and GC through B after a delete through A only condemns (two-phase GC). Each daemon
has its own state directory and socket; only the store is shared.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from contract.moto_server import CREDENTIALS, REGION, MotoServer, moto_missing

from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    read_lines_file,
    reference,
    wait_for_done,
    wait_for_lines,
    wait_state,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

MIB = 32
STEPS = 60
INTERVAL = 100


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    reason = moto_missing()
    if reason:
        pytest.skip(reason)
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shared_store_flags(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Flags of a daemon on a fresh bucket of ``moto``; the credentials moto wants are put in
    the environment the daemons (subprocesses) inherit."""
    for key, value in {**CREDENTIALS, "AWS_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    bucket = moto.new_bucket()
    return [
        "--store", f"s3://{bucket}/shared",
        "--store-endpoint", moto.endpoint,
        "--store-allow-http",
    ]


def _ids(d: Daemon) -> list[str]:
    listed = assert_ok(d.ctl("list"), "list")
    assert isinstance(listed, list)
    return [c["id"] for c in listed]


def _restore(d: Daemon, procs: Procs, ck: dict[str, Any]) -> dict[str, Any]:
    res = assert_ok(d.ctl("restore", ck["id"]), f"restore {ck['id']}")
    procs.add(res["pid"])
    assert res["id"] == ck["id"] and res["pid"] == ck["pid"]
    assert isinstance(res, dict)
    return res


def test_a_daemon_that_never_saw_the_job_restores_it_from_the_shared_store(
    start_daemon: Callable[..., Daemon],
    shared_store_flags: list[str],
    procs: Procs,
    workloads: Path,
) -> None:
    del workloads
    node_a = start_daemon(*shared_store_flags)
    node_b = start_daemon(*shared_store_flags)
    assert node_a.state_dir != node_b.state_dir and node_a.socket != node_b.socket

    cmd = workload("bigmem", "--mib", MIB, "--rewrite-pct", 1, "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    job = procs.popen(
        with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert job.stdout is not None
    reader = LineReader(job.stdout.fileno())
    reader.read_lines(3, timeout=30)

    # A dumps (and kills) the job
    first = assert_ok(node_a.ctl("dump", job.pid), "dump through A")
    pre = reader.read_to_eof()
    assert job.wait(timeout=10) == -signal.SIGKILL, "the dump did not kill the workload"
    assert first["bytes_new"] > MIB * (1 << 20) // 4

    # B never saw it: it lists it from the store, and restores it
    assert first["id"] in _ids(node_b)
    res = _restore(node_b, procs, first)
    assert res["output_path"], "stdout was a pipe: the restore must name its output file"
    output = Path(res["output_path"])
    post = wait_for_lines(output, 3, timeout=30)
    assert_continuity(pre, post, ref[: len(pre) + len(post)])

    # B dumps the restored job: its pages are A's, deduplicated
    second = assert_ok(node_b.ctl("dump", first["pid"]), "dump through B")
    wait_state(first["pid"], [None], timeout=10)
    post = read_lines_file(output)
    assert not post[-1].startswith("done"), "the restored job had finished before the dump"
    assert second["bytes_new"] < first["bytes_new"] // 4, (
        f"the dump through B added {second['bytes_new']} bytes, A's {first['bytes_new']}: "
        "pages A stored must not be stored again"
    )
    assert set(_ids(node_b)) == set(_ids(node_a)) == {first["id"], second["id"]}

    # A restores B's checkpoint (whose stdout is B's restore's output file, written on from
    # where the dump left it): the output still goes on, bit for bit
    _restore(node_a, procs, second)
    everything = wait_for_done(output, timeout=60)
    assert everything[: len(post)] == post
    assert len(everything) > len(post), "the job restored through A printed nothing"
    assert_continuity(pre, everything, ref)

    report = assert_ok(node_b.ctl("verify"), "verify through B")
    assert report["ok"] is True and report["problems"] == [], report
    assert sorted(report["checked"]) == sorted([first["id"], second["id"]])

    # Two-phase GC (default grace period: 6 h): what only A's checkpoint named is condemned,
    # not deleted, and the store stays whole for both daemons
    assert_ok(node_a.ctl("delete", first["id"]), "delete through A")
    gc = assert_ok(node_b.ctl("gc"), "gc through B")
    assert gc["packs_deleted"] == 0 and gc["blobs_deleted"] == 0, gc
    assert _ids(node_a) == _ids(node_b) == [second["id"]]
    report = assert_ok(node_a.ctl("verify"), "verify through A")
    assert report["ok"] is True and report["problems"] == [], report
