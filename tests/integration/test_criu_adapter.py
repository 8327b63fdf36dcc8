"""The CRIU adapter itself, against real CRIU: notifications reach the hooks in order, a
failing hook aborts the dump and leaves the process running, and gRPC's standard services
(health, reflection) answer on the daemon's public socket."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ckptd.core.ports import CriuDumpJob, CriuHooks, CriuRestoreJob
from ckptd.errors import CriuFailed
from ckptd.testing import RecordingHooks

from .flows import criu_swrk as _criu
from .support import Daemon, Procs, assert_running, wait_until

pytestmark = pytest.mark.integration


LIFECYCLE = ("pre_dump", "post_dump", "pre_restore", "post_restore", "post_resume")
"""The notifications these tests check the order of."""


def _sleeper(procs: Procs) -> int:
    proc = procs.popen(
        ["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    time.sleep(0.1)
    return proc.pid


def test_hooks_see_dump_and_restore_notifications_in_order(tmp_path: Path, procs: Procs) -> None:
    criu = _criu(tmp_path)
    pid = _sleeper(procs)
    images, work = tmp_path / "img", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    hooks = RecordingHooks()
    held = criu.dump(CriuDumpJob(pid, images, work, leave_running=False), hooks)
    assert hooks.only(*LIFECYCLE) == ["pre_dump", "post_dump"]
    assert held.pids == (pid,)
    assert _state(pid) in ("t", "T")  # CRIU holds it at post-dump
    result = held.finish()
    assert result.pids == (pid,)
    assert result.frozen_s > 0
    wait_until(lambda: not Path(f"/proc/{pid}/stat").exists()
               or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z",
               10, "the dumped process to be killed")
    procs.cleanup()  # reap the zombie so its pid is free
    hooks = RecordingHooks()
    restored = criu.restore(CriuRestoreJob(images, tmp_path / "work"), hooks)
    procs.add(restored)
    assert restored == pid
    assert hooks.only(*LIFECYCLE) == ["pre_restore", "post_restore", "post_resume"]
    assert_running(restored, "restored sleep")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


def test_a_dump_held_at_post_dump_then_abandoned_runs_on(tmp_path: Path, procs: Procs) -> None:
    criu = _criu(tmp_path)
    pid = _sleeper(procs)
    images, work = tmp_path / "img", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    held = criu.dump(CriuDumpJob(pid, images, work, leave_running=False, leave_stopped=True),
                     CriuHooks())
    assert _state(pid) in ("t", "T")
    held.abort()
    held.abort()
    wait_until(lambda: _state(pid) == "S", 10, "the abandoned dump's process to run again")
    with pytest.raises(CriuFailed):
        held.finish()


def test_a_failing_hook_aborts_the_dump_and_the_process_runs_on(
    tmp_path: Path, procs: Procs
) -> None:
    criu = _criu(tmp_path)
    pid = _sleeper(procs)
    images, work = tmp_path / "img", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    with pytest.raises(CriuFailed) as info:
        criu.dump(CriuDumpJob(pid, images, work, leave_running=False), RecordingHooks("post_dump"))
    assert "hook post_dump refuses" in str(info.value)
    assert info.value.log_tail  # the end of CRIU's log travels with the error
    time.sleep(0.2)
    assert_running(pid, "the target after an aborted dump")


def test_health_and_reflection_answer_on_the_public_socket(daemon: Daemon) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ckptd.v1.Checkpointer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "ckptd.v1.Checkpointer" in names
        assert "grpc.health.v1.Health" in names
