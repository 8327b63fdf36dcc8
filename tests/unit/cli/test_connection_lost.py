"""Issue 21 (11d): a daemon that goes away during a call (killed mid-dump) is not "is the
daemon running?": ckptctl says the connection was lost during the operation and that the
checkpoint may have committed, and how to see. The server is a real gRPC server in a child
process that exits (``os._exit``) in the middle of the call: a real broken connection."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.transport.cli import main as cli

SERVER = r"""
import os, sys, time
from concurrent import futures
import grpc
from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb, ckptd_pb2_grpc

class Dying(ckptd_pb2_grpc.CheckpointerServicer):
    def Dump(self, request, context):
        if sys.argv[2] == "after-progress":
            yield pb.DumpEvent(progress=pb.Progress(stage="criu-dump", fraction=0.5))
        time.sleep(0.2)
        os._exit(9)

    def Restore(self, request, context):
        time.sleep(0.2)
        os._exit(9)
        yield pb.RestoreEvent()

    def List(self, request, context):
        time.sleep(0.2)
        os._exit(9)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
ckptd_pb2_grpc.add_CheckpointerServicer_to_server(Dying(), server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckctl-") as d:
        yield Path(d)


def dying_server(socket: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(socket), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def ctl(capsys: pytest.CaptureFixture[str], socket: Path, *args: str) -> tuple[int, str]:
    started = time.monotonic()
    code = cli.main(["--socket", str(socket), *args])
    assert time.monotonic() - started < 30
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("ckptctl: ") and err.count("\n") == 1 and err.endswith("\n"), err
    return code, err


@pytest.mark.parametrize("mode", ["after-progress", "before-any-event"])
def test_a_daemon_gone_mid_dump_says_the_checkpoint_may_have_committed(
    capsys: pytest.CaptureFixture[str], short_dir: Path, mode: str
) -> None:
    socket = short_dir / "ckptd.sock"
    server = dying_server(socket, mode)
    try:
        code, err = ctl(capsys, socket, "dump", "4242")
    finally:
        server.kill()
        server.wait()
    assert code == 3
    assert "is the daemon running" not in err, err
    assert "ckptd went away during the dump of pid 4242" in err, err
    assert "may have committed" in err and "`ckptctl list --pid 4242`" in err, err


def test_a_daemon_gone_mid_restore_says_it_may_have_completed(
    capsys: pytest.CaptureFixture[str], short_dir: Path
) -> None:
    socket = short_dir / "ckptd.sock"
    server = dying_server(socket, "")
    try:
        code, err = ctl(capsys, socket, "restore", "ck-20240501T120000-a1b2c3")
    finally:
        server.kill()
        server.wait()
    assert code == 3
    assert "ckptd went away during the restore" in err and "`ckptctl list`" in err, err


def test_a_daemon_gone_mid_list_says_so_and_to_retry(
    capsys: pytest.CaptureFixture[str], short_dir: Path
) -> None:
    socket = short_dir / "ckptd.sock"
    server = dying_server(socket, "")
    try:
        code, err = ctl(capsys, socket, "list")
    finally:
        server.kill()
        server.wait()
    assert code == 3
    assert "ckptd went away during the request" in err and "retry" in err, err
    assert "may have committed" not in err, err


def test_no_daemon_at_all_is_still_is_the_daemon_running(
    capsys: pytest.CaptureFixture[str], short_dir: Path
) -> None:
    code, err = ctl(capsys, short_dir / "none.sock", "dump", "4242")
    assert code == 3
    assert "is the daemon running?" in err, err
