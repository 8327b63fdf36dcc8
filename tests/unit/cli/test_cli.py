"""ckptctl against a real in-process gRPC server (fake servicer) on a Unix socket."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc
from ckptd.transport.cli import convert, render
from ckptd.transport.cli import main as cli

ROOT = Path(__file__).resolve().parents[3]

CK_ID = "ck-20240501T120000-a1b2c3"
UNAVAILABLE_LINE = (
    "ckptctl: cannot reach ckptd at {path}: is the daemon running? "
    "(start it with 'ckptd' or 'systemctl start ckptd')\n"
)


def sample_checkpoint(ck_id: str = CK_ID, pid: int = 4242, name: str = "train") -> pb.Checkpoint:
    ck = pb.Checkpoint(
        id=ck_id,
        pid=pid,
        name=name,
        labels={"team": "ml", "env": "dev"},
        node="node-a",
        uid=1000,
        leave_running=False,
        processes=[
            pb.ProcessFact(
                pid=pid,
                ppid=1,
                comm="python",
                cmdline=["python", "train.py", "--epochs", "10"],
                uid=1000,
                gid=1000,
                threads=8,
            ),
            pb.ProcessFact(
                pid=pid + 8, ppid=pid, comm="worker", cmdline=["python", "-m", "worker"], uid=1000
            ),
        ],
        stdio=[
            pb.StdioFact(
                pid=pid, fd=1, kind="pipe", target="pipe:[98765]", on_restore="output file"
            ),
            pb.StdioFact(pid=pid, fd=2, kind="tty", target="/dev/pts/3", on_restore="output file"),
        ],
        bytes=256 * 1024 * 1024,
        bytes_logical=1024 * 1024 * 1024,
        bytes_new=50 * 1024 * 1024,
        frozen_s=0.42,
        duration_s=1.87,
        criu_version="4.0",
        parent_id="ck-20240501T110000-0f0f0f",
    )
    ck.created.FromJsonString("2024-05-01T12:00:00Z")
    return ck


def sample_check(criu_ok: bool = True) -> pb.CheckResponse:
    return pb.CheckResponse(
        node="node-a",
        kernel="6.8.0-45-generic",
        daemon_version="0.1.0",
        criu_path="/usr/sbin/criu",
        criu_version="4.0",
        criu_ok=criu_ok,
        criu_message="" if criu_ok else "criu check failed: no userfaultfd",
        features=[
            pb.Feature(name="mem_dirty_track", ok=True),
            pb.Feature(name="uffd", ok=False, detail="kernel has no userfaultfd"),
        ],
        gpu_available=True,
        gpu_message="cuda-checkpoint 550.54",
        gpus=[pb.Gpu(index=0, name="NVIDIA H100", uuid="GPU-1234", memory_total=80 * 1024**3)],
        store="/var/lib/ckptd",
    )


@dataclass
class FakeCheckpointer(ckptd_pb2_grpc.CheckpointerServicer):
    """Returns canned answers, records every request, aborts with ``fail`` when set."""

    requests: list[tuple[str, Any]] = field(default_factory=list)
    fail: tuple[grpc.StatusCode, str] | None = None
    delay_s: float = 0.0
    stream_result: bool = True
    checkpoints: list[pb.Checkpoint] = field(
        default_factory=lambda: [
            sample_checkpoint(),
            sample_checkpoint("ck-20240502T080910-ffee00", 77, ""),
        ]
    )
    check: pb.CheckResponse = field(default_factory=sample_check)
    compat: pb.CheckRestoreResponse = field(
        default_factory=lambda: pb.CheckRestoreResponse(compatible=True)
    )
    gc: pb.GcResponse = field(default_factory=pb.GcResponse)

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append((method, request))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail is not None:
            context.abort(*self.fail)

    def Dump(
        self, request: pb.DumpRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DumpEvent]:
        self._enter("Dump", request, context)
        for stage, fraction in (("inspect", 0.1), ("criu-dump", 0.6), ("commit", 0.95)):
            yield pb.DumpEvent(progress=pb.Progress(stage=stage, message="...", fraction=fraction))
        if self.stream_result:
            ck = sample_checkpoint(pid=request.pid, name=request.name)
            ck.leave_running = request.leave_running
            ck.labels.clear()
            ck.labels.update(request.labels)
            yield pb.DumpEvent(checkpoint=ck)

    def Restore(
        self, request: pb.RestoreRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RestoreEvent]:
        self._enter("Restore", request, context)
        yield pb.RestoreEvent(progress=pb.Progress(stage="criu-restore", fraction=0.5))
        yield pb.RestoreEvent(
            result=pb.RestoreResult(
                checkpoint_id=CK_ID,
                pid=5151,
                output_path=request.output_path or "/var/lib/ckptd/out/5151.log",
                duration_s=0.73,
                stdio=[pb.StdioFact(pid=5151, fd=1, kind="file", target="/tmp/x.log")],
            )
        )

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        self._enter("List", request, context)
        return pb.ListResponse(checkpoints=self.checkpoints)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.Checkpoint:
        self._enter("Get", request, context)
        return sample_checkpoint(request.id)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        self._enter("Delete", request, context)
        return pb.DeleteResponse(id=request.id)

    def Check(self, request: pb.CheckRequest, context: grpc.ServicerContext) -> pb.CheckResponse:
        self._enter("Check", request, context)
        return self.check

    def CheckRestore(
        self, request: pb.CheckRestoreRequest, context: grpc.ServicerContext
    ) -> pb.CheckRestoreResponse:
        self._enter("CheckRestore", request, context)
        return self.compat

    def Gc(self, request: pb.GcRequest, context: grpc.ServicerContext) -> pb.GcResponse:
        self._enter("Gc", request, context)
        return self.gc


@dataclass
class Daemon:
    servicer: FakeCheckpointer
    socket: str

    def last(self, method: str) -> Any:
        matching = [req for name, req in self.servicer.requests if name == method]
        assert matching, f"the server got no {method} request"
        return matching[-1]


def _short_dir(tmp_path: Path) -> Path:
    """A Unix socket path must fit in sun_path (108 bytes); pytest's tmp_path may not."""
    if len(str(tmp_path / "ckptd.sock")) < 100:
        return tmp_path
    return Path(tempfile.mkdtemp(prefix="ckctl-"))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    directory = _short_dir(tmp_path)
    socket = str(directory / "ckptd.sock")
    servicer = FakeCheckpointer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ckptd_pb2_grpc.add_CheckpointerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port("unix:" + socket)
    server.start()
    try:
        yield Daemon(servicer, socket)
    finally:
        server.stop(None)
        if directory != tmp_path:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is UTC, and CKPTD_SOCKET unset, unless a test says otherwise."""
    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def run(capsys: pytest.CaptureFixture[str], daemon: Daemon, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--socket", daemon.socket, *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str) -> None:
    assert err.startswith("ckptctl: ")
    assert err.endswith("\n")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------
# dump


def test_dump_human(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = run(capsys, daemon, "dump", "4242")
    assert code == 0
    assert out == (
        f"checkpoint {CK_ID} of pid 4242: 1.0 GiB of images, 256.0 MiB stored, 50.0 MiB new, "
        "in 1.87s (frozen 0.42s)\n"
    )
    assert err == ""  # stderr is not a terminal: no progress at all
    request = daemon.last("Dump")
    assert request.pid == 4242
    assert not request.leave_running
    assert request.name == ""
    assert dict(request.labels) == {}


def test_dump_sends_options(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, _ = run(
        capsys,
        daemon,
        "dump",
        "4242",
        "--leave-running",
        "--name",
        "train",
        "--label",
        "team=ml",
        "--label",
        "note=a=b",
    )
    assert code == 0
    request = daemon.last("Dump")
    assert request.leave_running
    assert request.name == "train"
    assert dict(request.labels) == {"team": "ml", "note": "a=b"}


def test_dump_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = run(capsys, daemon, "--json", "dump", "4242", "--label", "k=v")
    assert code == 0
    assert err == ""
    data = json.loads(out)
    assert isinstance(data, dict)
    types = {
        "id": str,
        "pid": int,
        "bytes": int,
        "bytes_logical": int,
        "bytes_new": int,
        "name": str,
        "labels": dict,
        "created": str,
        "frozen_s": float,
        "duration_s": float,
        "leave_running": bool,
        "node": str,
        "parent_id": str,
    }
    for key, kind in types.items():
        assert isinstance(data[key], kind), key
    assert data["id"] == CK_ID
    assert data["pid"] == 4242
    assert data["bytes"] == 256 * 1024 * 1024
    assert data["labels"] == {"k": "v"}
    assert data["created"] == "2024-05-01T12:00:00Z"


def test_dump_progress_on_a_terminal(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    code = cli.main(["--socket", daemon.socket, "dump", "4242"])
    out, _ = capsys.readouterr()
    assert code == 0
    text = tty.getvalue()
    assert "\n" not in text  # one line, rewritten with \r
    assert text.count("\r") >= 3
    assert "[##..................] 10% inspect: ..." in text
    assert "criu-dump" in text
    assert "commit" in text
    assert text.endswith("\r") and text.rsplit("\r", 2)[-2].strip() == ""  # erased at the end
    assert out.startswith(f"checkpoint {CK_ID} of pid 4242:")


@pytest.mark.parametrize("pid", ["abc", "0", "-5", "1.5", "99999999999"])
def test_dump_invalid_pid(capsys: pytest.CaptureFixture[str], daemon: Daemon, pid: str) -> None:
    code, out, err = run(capsys, daemon, "dump", pid)
    assert code == 2
    assert out == ""
    assert_one_error_line(err)
    assert "invalid pid" in err
    assert daemon.servicer.requests == []


def test_dump_bad_label_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    code, _, err = run(capsys, daemon, "dump", "42", "--label", "novalue")
    assert code == 2
    assert_one_error_line(err)  # issue 14: a usage error is one line, not argparse's block
    assert "--help'" in err
    assert "expected KEY=VALUE" in err


def test_dump_stream_without_result(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.stream_result = False
    code, out, err = run(capsys, daemon, "dump", "42")
    assert code == 1
    assert out == ""
    assert_one_error_line(err)
    assert "without a result" in err


# --------------------------------------------------------------------------------------------
# restore


def test_restore_by_pid(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "restore", "4242")
    assert code == 0
    request = daemon.last("Restore")
    assert request.WhichOneof("target") == "pid"
    assert request.pid == 4242
    assert request.output_path == ""
    assert out == (f"restored {CK_ID} as pid 5151 in 0.73s\noutput: /var/lib/ckptd/out/5151.log\n")


def test_restore_by_id(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, _ = run(capsys, daemon, "restore", CK_ID, "--output", "/tmp/o.log")
    assert code == 0
    request = daemon.last("Restore")
    assert request.WhichOneof("target") == "checkpoint_id"
    assert request.checkpoint_id == CK_ID
    assert request.output_path == "/tmp/o.log"


def test_restore_by_name(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, _ = run(capsys, daemon, "restore", "--name", "train")
    assert code == 0
    request = daemon.last("Restore")
    assert request.WhichOneof("target") == "name"
    assert request.name == "train"


def test_restore_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "restore", "4242", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["id"] == CK_ID
    assert data["pid"] == 5151
    assert data["output_path"] == "/var/lib/ckptd/out/5151.log"
    assert data["duration_s"] == pytest.approx(0.73)


@pytest.mark.parametrize("args", [[], ["4242", "--name", "train"]])
def test_restore_needs_exactly_one_target(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, args: list[str]
) -> None:
    code, out, err = run(capsys, daemon, "restore", *args)
    assert code == 2
    assert out == ""
    assert_one_error_line(err)  # issue 14: a usage error is one line, not argparse's block
    assert "--help'" in err
    assert daemon.servicer.requests == []


def test_restore_pid_zero_is_invalid(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, err = run(capsys, daemon, "restore", "0")
    assert code == 2
    assert_one_error_line(err)


# --------------------------------------------------------------------------------------------
# list, show, delete, check


def test_list_table(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "list", "--pid", "4242", "--name", "train")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "PID", "NAME", "CREATED", "AGE", "SIZE", "NEW", "NODE"]
    assert re.fullmatch(
        r"ck-20240501T120000-a1b2c3  4242  train  2024-05-01 12:00:00  \d+d +256\.0 MiB  "
        r"50\.0 MiB  node-a", lines[1]), lines[1]
    assert lines[2].startswith("ck-20240502T080910-ffee00  77    -      2024-05-01 12:00:00")
    assert len(lines) == 3
    request = daemon.last("List")
    assert request.pid == 4242
    assert request.name == "train"


def test_list_empty(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.checkpoints = []
    code, out, _ = run(capsys, daemon, "list")
    assert code == 0
    assert out == "no checkpoints\n"
    code, out, _ = run(capsys, daemon, "list", "--json")
    assert json.loads(out) == []


def test_list_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert isinstance(data, list)
    assert [ck["id"] for ck in data] == [CK_ID, "ck-20240502T080910-ffee00"]
    for ck in data:
        assert {"id", "pid", "name", "created", "bytes", "node", "labels"} <= ck.keys()
        assert isinstance(ck["bytes"], int)
        assert isinstance(ck["labels"], dict)
    assert daemon.last("List").pid == 0


def test_list_bad_pid_is_a_usage_error(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, err = run(capsys, daemon, "list", "--pid", "x")
    assert code == 2
    assert_one_error_line(err)  # issue 14: a usage error is one line, not argparse's block
    assert "--help'" in err


def test_show_json_has_every_field(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "show", CK_ID, "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {f.name for f in pb.Checkpoint.DESCRIPTOR.fields}
    assert daemon.last("Get").id == CK_ID
    assert data["created"] == "2024-05-01T12:00:00Z"
    assert data["processes"][0] == {
        "pid": 4242,
        "ppid": 1,
        "comm": "python",
        "cmdline": ["python", "train.py", "--epochs", "10"],
        "uid": 1000,
        "gid": 1000,
        "threads": 8,
        "ns_pid": 0,
    }
    assert data["stdio"][1] == {
        "pid": 4242,
        "fd": 2,
        "kind": "tty",
        "target": "/dev/pts/3",
        "on_restore": "output file",
    }
    assert data["labels"] == {"env": "dev", "team": "ml"}


def test_show_human(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "show", CK_ID)
    assert code == 0
    assert out.splitlines() == [
        "id:            ck-20240501T120000-a1b2c3",
        "pid:           4242",
        "name:          train",
        "labels:        env=dev, team=ml",
        "created:       2024-05-01 12:00:00 (2024-05-01T12:00:00Z)",
        "node:          node-a",
        "uid:           1000",
        "leave running: no",
        "logical size:  1.0 GiB (1073741824 bytes)",
        "stored size:   256.0 MiB (268435456 bytes)",
        "new size:      50.0 MiB (52428800 bytes)",
        "compression:   4.00x (logical/stored: compressed frames and zero pages)",
        "dedup:         5.12x (stored/new: shared with earlier checkpoints)",
        "frozen:        0.42s",
        "total:         1.87s",
        "criu version:  4.0",
        "parent:        ck-20240501T110000-0f0f0f",
        "processes (2):",
        "  PID   PPID  COMM    CMDLINE",
        "  4242  1     python  python train.py --epochs 10",
        "  4250  4242  worker  python -m worker",
        "stdio (2):",
        "  PID   FD  KIND  TARGET            ON RESTORE",
        "  4242  1   pipe  pipe:[98765]  ->  output file",
        "  4242  2   tty   /dev/pts/3    ->  output file",
    ]


def test_show_human_omits_ratios_when_sizes_are_zero() -> None:
    ck = convert.checkpoint_to_dict(pb.Checkpoint(id="ck-x"))
    text = render.checkpoint_details(ck)
    assert "compression" not in text
    assert "dedup" not in text
    assert "created:       -" in text
    assert "processes: -" in text
    assert ck["created"] is None


def test_delete(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "delete", CK_ID)
    assert code == 0
    assert out == f"deleted {CK_ID}\n"
    assert daemon.last("Delete").id == CK_ID
    code, out, _ = run(capsys, daemon, "delete", CK_ID, "--json")
    assert json.loads(out) == {"id": CK_ID}


def test_check_human(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = run(capsys, daemon, "check")
    assert code == 0
    assert err == ""
    assert "node:           node-a" in out
    assert "kernel:         6.8.0-45-generic" in out
    assert "daemon version: 0.1.0" in out
    assert "criu:           /usr/sbin/criu 4.0 (ok)" in out
    assert "  ok    mem_dirty_track" in out
    assert "  FAIL  uffd             kernel has no userfaultfd" in out
    assert "gpu:            available (1 GPU): cuda-checkpoint 550.54" in out
    assert "NVIDIA H100" in out
    assert "store:          /var/lib/ckptd" in out
    assert "PROBLEM" not in out


def test_check_criu_not_ok_is_still_exit_0(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.check = sample_check(criu_ok=False)
    code, out, _ = run(capsys, daemon, "check")
    assert code == 0
    assert "(NOT OK)" in out
    assert out.rstrip().splitlines()[-1] == (
        "PROBLEM: CRIU is not usable on this node, so dump and restore will fail: "
        "criu check failed: no userfaultfd"
    )


def test_check_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = run(capsys, daemon, "check", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {f.name for f in pb.CheckResponse.DESCRIPTOR.fields}
    assert data["criu_ok"] is True
    assert data["features"][1] == {
        "name": "uffd",
        "ok": False,
        "detail": "kernel has no userfaultfd",
    }
    assert data["gpus"][0]["memory_total"] == 80 * 1024**3


# --------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("status", "exit_code"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 2),
        (grpc.StatusCode.NOT_FOUND, 2),
        (grpc.StatusCode.PERMISSION_DENIED, 2),
        (grpc.StatusCode.FAILED_PRECONDITION, 2),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 4),
        (grpc.StatusCode.ABORTED, 4),
        (grpc.StatusCode.INTERNAL, 1),
        (grpc.StatusCode.UNKNOWN, 1),
        (grpc.StatusCode.CANCELLED, 1),
    ],
)
@pytest.mark.parametrize("command", [["show", CK_ID], ["dump", "4242"], ["restore", "4242"]])
def test_error_codes(
    capsys: pytest.CaptureFixture[str],
    daemon: Daemon,
    status: grpc.StatusCode,
    exit_code: int,
    command: list[str],
) -> None:
    message = "process 4242 is busy; wait for the running operation to finish, then retry"
    daemon.servicer.fail = (status, message)
    code, out, err = run(capsys, daemon, *command)
    assert code == exit_code
    assert out == ""
    assert err == f"ckptctl: {message}\n"


def test_error_details_are_one_line(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.fail = (grpc.StatusCode.INTERNAL, "criu failed\nlog tail:\n  Error (x)")
    code, _, err = run(capsys, daemon, "list")
    assert code == 1
    assert err == "ckptctl: criu failed log tail: Error (x)\n"


def test_error_unavailable_from_the_daemon(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.fail = (grpc.StatusCode.UNAVAILABLE, "shutting down")
    code, _, err = run(capsys, daemon, "list")
    assert code == 3
    assert err == UNAVAILABLE_LINE.format(path=daemon.socket)


def test_unavailable_when_nothing_listens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "nope.sock")
    for args in (["list"], ["dump", "42"], ["check", "--json"]):
        code = cli.main(["--socket", missing, *args])
        out, err = capsys.readouterr()
        assert code == 3
        assert out == ""
        assert err == UNAVAILABLE_LINE.format(path=missing)


def test_deadline_exceeded(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.delay_s = 1.0
    code, _, err = run(capsys, daemon, "list", "--timeout", "0.2")
    assert code == 1
    assert_one_error_line(err)
    assert "did not answer within 0.2s" in err


def test_a_dump_past_the_client_timeout_says_the_daemon_may_still_complete_it(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    """Issue 14: not `Stream removed (Deadline Exceeded)`: the dump goes on in the daemon
    (and, in stop mode, stops the job); say so, and how to check."""
    daemon.servicer.delay_s = 1.0
    code, _, err = run(capsys, daemon, "dump", "42", "--timeout", "0.2")
    assert code == 1
    assert_one_error_line(err)
    assert "may still complete (and then stop the job)" in err
    assert "`ckptctl list --pid 42`" in err
    assert "Deadline" not in err and "Stream removed" not in err


def test_a_restore_past_the_client_timeout_says_how_to_check(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.delay_s = 1.0
    code, _, err = run(capsys, daemon, "restore", CK_ID, "--timeout", "0.2")
    assert code == 1
    assert_one_error_line(err)
    assert "the restore goes on in the daemon and may still complete" in err


def test_keyboard_interrupt(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(ctx: cli.Context, args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_list", interrupted)
    code, _, err = run(capsys, daemon, "list")
    assert code == 130
    assert err == "ckptctl: interrupted\n"


def test_unexpected_exception_has_no_traceback(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: cli.Context, args: Any) -> int:
        raise RuntimeError("boom")

    monkeypatch.delenv("CKPTCTL_DEBUG", raising=False)
    monkeypatch.setattr(cli, "cmd_list", broken)
    code, _, err = run(capsys, daemon, "list")
    assert code == 1
    assert_one_error_line(err)
    assert "RuntimeError: boom" in err


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["show"]) == 2
    assert cli.main(["list", "--timeout", "-1"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(ln.startswith("ckptctl: ") for ln in lines), lines
    assert cli.main(["--help"]) == 0
    assert "dump" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# global options


def test_socket_option_beats_the_environment(
    capsys: pytest.CaptureFixture[str],
    daemon: Daemon,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "missing.sock")
    monkeypatch.setenv("CKPTD_SOCKET", missing)
    assert cli.main(["list"]) == 3  # the environment is used when there is no --socket
    assert capsys.readouterr().err == UNAVAILABLE_LINE.format(path=missing)
    assert cli.main(["--socket", daemon.socket, "list"]) == 0
    assert cli.main(["list", "--socket", daemon.socket]) == 0
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    assert cli.main(["list"]) == 0
    assert cli.main(["list", "--socket", missing]) == 3


def test_default_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    args = cli.build_parser().parse_args(["list"])
    assert cli._resolve_socket(args) == "/run/ckptd/ckptd.sock"
    monkeypatch.setenv("CKPTD_SOCKET", "")
    assert cli._resolve_socket(args) == "/run/ckptd/ckptd.sock"


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "--socket", "{s}", "list"],
        ["--socket", "{s}", "list", "--json"],
        ["list", "--json", "--socket", "{s}"],
        ["--json", "list", "--socket", "{s}"],
    ],
)
def test_global_options_before_and_after_the_command(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, argv: list[str]
) -> None:
    code = cli.main([a.format(s=daemon.socket) for a in argv])
    out, _ = capsys.readouterr()
    assert code == 0
    assert isinstance(json.loads(out), list)


def test_timeout_defaults() -> None:
    parser = cli.build_parser()
    assert cli._resolve_timeout(parser.parse_args(["dump", "1"])) is None
    assert cli._resolve_timeout(parser.parse_args(["restore", "1"])) is None
    assert cli._resolve_timeout(parser.parse_args(["list"])) == 30.0
    assert cli._resolve_timeout(parser.parse_args(["check"])) == 30.0
    assert cli._resolve_timeout(parser.parse_args(["--timeout", "5", "dump", "1"])) == 5.0
    assert cli._resolve_timeout(parser.parse_args(["show", CK_ID, "--timeout", "2.5"])) == 2.5


# --------------------------------------------------------------------------------------------
# completion, rendering, the console script


def test_bash_completion(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete -F _ckptctl ckptctl" in script
    for word in ("dump", "restore", "list", "show", "delete", "check", "completion"):
        assert word in script
    for flag in ("--leave-running", "--label", "--output", "--socket", "--json", "--timeout"):
        assert flag in script
    bash = shutil.which("bash")
    if bash:
        result = subprocess.run(
            [bash, "-n"], check=False, input=script, text=True, capture_output=True
        )
        assert result.returncode == 0, result.stderr


def test_bash_completion_completes(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if not bash:
        pytest.skip("no bash")
    script = cli.bash_completion(cli.build_parser())
    probe = (
        script
        + '\nCOMP_WORDS=(ckptctl dump --l); COMP_CWORD=2; _ckptctl; echo "${COMPREPLY[*]}"'
        + '\nCOMP_WORDS=(ckptctl --json re); COMP_CWORD=2; _ckptctl; echo "${COMPREPLY[*]}"'
    )
    result = subprocess.run([bash, "-c", probe], text=True, capture_output=True, check=True)
    assert result.stdout.splitlines() == ["--leave-running --label", "resume restore"]


def test_human_bytes() -> None:
    assert render.human_bytes(0) == "0 B"
    assert render.human_bytes(1023) == "1023 B"
    assert render.human_bytes(1536) == "1.5 KiB"
    assert render.human_bytes(5 * 1024**3) == "5.0 GiB"
    assert render.human_bytes(3 * 1024**7).endswith("EiB")


def test_console_script_exit_code(tmp_path: Path) -> None:
    """`python -m` and the console script both exit with main()'s code, one line, no trace."""
    env = {**os.environ, "CKPTD_SOCKET": str(tmp_path / "none.sock")}
    env.pop("CKPTCTL_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "ckptd.transport.cli", "list"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 3
    assert result.stdout == ""
    assert result.stderr == UNAVAILABLE_LINE.format(path=tmp_path / "none.sock")


def test_show_human_prints_gpu_facts() -> None:
    ck_msg = pb.Checkpoint(id="ck-x")
    ck_msg.gpu.CopyFrom(
        pb.GpuFacts(
            driver_version="580.159.03",
            cuda_version=13000,
            gpus=[pb.Gpu(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-aa",
                         memory_total=80 << 30)],
            uses=[pb.GpuUse(pid=4242, uuid="GPU-aa", memory=3 << 30)],
            cuda_pids=[4242],
            lock_s=0.01, checkpoint_s=1.5, restore_s=1.25, unlock_s=0.02,
        )
    )
    text = render.checkpoint_details(convert.checkpoint_to_dict(ck_msg))
    assert "gpu: driver 580.159.03, CUDA 13.0; cuda pids 4242" in text
    assert "checkpoint 1.50s" in text
    assert "NVIDIA H100 80GB HBM3" in text
    assert "3.0 GiB" in text


def test_show_human_names_the_inner_pid_of_a_pid_namespace_job() -> None:
    ck = convert.checkpoint_to_dict(pb.Checkpoint(id="ck-x", processes=[
        pb.ProcessFact(pid=41872, ppid=41870, comm="python", ns_pid=1),
        pb.ProcessFact(pid=41901, ppid=41872, comm="worker", ns_pid=7),
        pb.ProcessFact(pid=500, ppid=1, comm="plain"),
    ]))
    assert [p["ns_pid"] for p in ck["processes"]] == [1, 7, 0]
    text = render.checkpoint_details(ck)
    assert "41872 (ns 1)" in text and "41901 (ns 7)" in text
    assert "500 (ns" not in text


def test_show_human_has_no_gpu_part_without_cuda() -> None:
    text = render.checkpoint_details(convert.checkpoint_to_dict(pb.Checkpoint(id="ck-x")))
    assert "gpu:" not in text


def test_restore_sends_the_gpu_map(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, _ = run(
        capsys, daemon, "restore", CK_ID, "--gpu-map", "GPU-a=GPU-b", "--gpu-map", "GPU-c=GPU-d"
    )
    assert code == 0
    assert dict(daemon.last("Restore").gpu_map) == {"GPU-a": "GPU-b", "GPU-c": "GPU-d"}


# --------------------------------------------------------------------------------------------
# check-restore, restore --ignore-warnings, the fingerprint in show

INCOMPATIBLE = pb.CheckRestoreResponse(
    compatible=False,
    blocking=["file /data/tokenizer.json changed (mtime/content differs)",
              "CPU lacks avx512f used at dump"],
    warnings=["kernel differs: 6.8.0 -> 6.1.0"],
)


def test_check_restore_compatible(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = run(capsys, daemon, "check-restore", CK_ID)
    assert (code, out, err) == (0, "compatible\n", "")
    assert daemon.last("CheckRestore").id == CK_ID


def test_check_restore_lists_every_difference(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.compat = INCOMPATIBLE
    code, out, _ = run(capsys, daemon, "check-restore", CK_ID)
    assert code == 1
    assert out.splitlines() == [
        "blocking (2): a restore is refused",
        "  - file /data/tokenizer.json changed (mtime/content differs)",
        "  - CPU lacks avx512f used at dump",
        "warnings (1): a restore is refused unless --ignore-warnings",
        "  - kernel differs: 6.8.0 -> 6.1.0",
    ]


def test_check_restore_warnings_only(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.compat = pb.CheckRestoreResponse(warnings=["libc differs: a -> b"])
    code, out, _ = run(capsys, daemon, "check-restore", CK_ID)
    assert code == 1
    assert "blocking" not in out and "  - libc differs: a -> b" in out


def test_check_restore_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    daemon.servicer.compat = INCOMPATIBLE
    code, out, _ = run(capsys, daemon, "check-restore", CK_ID, "--json")
    assert code == 1
    assert json.loads(out) == {
        "compatible": False,
        "blocking": list(INCOMPATIBLE.blocking),
        "warnings": list(INCOMPATIBLE.warnings),
        "notes": [],
    }


def test_check_restore_lists_the_files_a_restore_puts_back(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    note = "file /srv/train.log differs from the checkpoint: it is put back (14 bytes), ..."
    daemon.servicer.compat = pb.CheckRestoreResponse(compatible=True, notes=[note])
    code, out, _ = run(capsys, daemon, "check-restore", CK_ID)
    assert code == 0
    assert out.splitlines() == ["compatible", "a restore also (1):", f"  - {note}"]


def test_check_restore_needs_an_id(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, _, err = run(capsys, daemon, "check-restore")
    assert code == 2
    assert_one_error_line(err)


def test_check_restore_refusal_is_one_line(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.fail = (grpc.StatusCode.NOT_FOUND, "no checkpoint ck-x")
    code, _, err = run(capsys, daemon, "check-restore", "ck-x")
    assert code == 2
    assert_one_error_line(err)


def test_restore_sends_ignore_warnings(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    assert run(capsys, daemon, "restore", CK_ID)[0] == 0
    assert daemon.last("Restore").ignore_warnings is False
    assert run(capsys, daemon, "restore", CK_ID, "--ignore-warnings")[0] == 0
    assert daemon.last("Restore").ignore_warnings is True


def test_restore_refused_as_incompatible_is_one_line(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.fail = (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"checkpoint {CK_ID} does not fit this node: blocking: file /d/x changed (content "
        "differs); restore it on a node that matches, or put the files back as they were",
    )
    code, _, err = run(capsys, daemon, "restore", CK_ID)
    assert code == 2
    assert_one_error_line(err)
    assert "file /d/x changed" in err


def test_show_human_prints_the_fingerprint_summary() -> None:
    ck_msg = pb.Checkpoint(id="ck-x")
    ck_msg.fingerprint.CopyFrom(
        pb.NodeFingerprint(arch="x86_64", cpu_model="AMD EPYC 9654", cpu_flags=120,
                           kernel="6.8.0", libc="glibc 2.39", criu_version="4.1", files=42,
                           directories=1, mounts=2)
    )
    text = render.checkpoint_details(convert.checkpoint_to_dict(ck_msg))
    assert text.splitlines()[-6:] == [
        "node fingerprint:",
        "  arch:         x86_64",
        "  cpu model:    AMD EPYC 9654 (120 flags)",
        "  kernel:       6.8.0",
        "  libc:         glibc 2.39",
        "  files needed: 42 (+ 1 working directory, 2 mount points)",
    ]


def test_bash_completion_knows_check_restore() -> None:
    script = cli.bash_completion(cli.build_parser())
    assert "check-restore" in script and "--ignore-warnings" in script


def test_gc_human_reports_compaction_and_what_each_checkpoint_pins() -> None:
    msg = pb.GcResponse(
        packs_deleted=4, bytes_freed=3 << 20, packs_kept=2, bytes_kept=5 << 20,
        packs_rewritten=4, bytes_rewritten=3 << 20, packs_written=1, bytes_written=1 << 20,
        bytes_condemned=0,
        pinned=[pb.GcPinned(checkpoint_id="ck-b", packs=2, bytes=5 << 20, bytes_alone=1 << 20),
                pb.GcPinned(checkpoint_id="ck-a", packs=1, bytes=4 << 20)],
    )
    lines = render.gc_report(convert.message_to_dict(msg)).splitlines()
    assert lines[0].startswith("freed 3.0 MiB: 4 pack(s)")
    assert lines[1] == "compacted 4 pack(s), 3.0 MiB, into 1 pack(s), 1.0 MiB"
    assert lines[2].startswith("pinned by checkpoint")
    assert lines[3].split()[:4] == ["ck-b", "5.0", "MiB", "in"]
    assert lines[4].startswith("  ck-a")


FULL_LINE = ("compaction skipped: the store's filesystem is full (No space left on device); "
             "freed 1048576 bytes first; run gc again once there is room")


def test_gc_on_a_full_store_says_compaction_was_skipped(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    daemon.servicer.gc = pb.GcResponse(packs_deleted=1, bytes_freed=1 << 20, packs_kept=3,
                                       bytes_kept=9 << 20, skipped=[FULL_LINE])
    code, out, err = run(capsys, daemon, "gc")
    assert (code, err) == (0, "")
    assert out.splitlines()[:2] == [
        "freed 1.0 MiB: 1 pack(s), 0 blob(s); kept 3 pack(s), 9.0 MiB", FULL_LINE]
    assert daemon.last("Gc").no_compact is False
    code, out, _ = run(capsys, daemon, "--json", "gc")
    assert code == 0 and json.loads(out)["skipped"] == [FULL_LINE]


def test_gc_no_compact_asks_for_no_compaction(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    code, _, _ = run(capsys, daemon, "gc", "--no-compact", "--keep-last", "2")
    assert code == 0
    request = daemon.last("Gc")
    assert (request.no_compact, request.keep_last) == (True, 2)
