"""A spot notice drains the protected jobs, ``ckptctl resume --all`` brings them back exactly,
and the Prometheus endpoint counts it all; without ``metrics_listen`` there is no endpoint.

The cloud is a fake AWS instance-metadata service on 127.0.0.1 (IMDSv2 token, then
``/latest/meta-data/spot/instance-action``: 404 until the test switches the notice on, then
200 with the action and time), which the daemon polls through ``spot_aws_url``."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_running,
    is_alive,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 200
INTERVAL = 25
MEM_MIB = 8
UNPROTECTED_STEPS = 100_000
"""The unprotected job must still be running when the protected one has been drained, however
slow the machine: it runs far longer than the test."""
AWS_PATH = "/latest/meta-data/spot/instance-action"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeAws:
    """IMDSv2 as AWS serves it: ``PUT /latest/api/token`` gives a token; the instance-action
    GET without a valid one is 401; 404 while no notice, 200 JSON once ``notice`` is set."""

    def __init__(self) -> None:
        self.notice = threading.Event()
        self.tokens: set[str] = set()
        self.gets = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

            def _send(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path != "/latest/api/token":
                    self._send(404)
                    return
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(400)
                    return
                token = secrets.token_urlsafe(24)
                with fake.lock:
                    fake.tokens.add(token)
                self._send(200, token.encode())

            def do_GET(self) -> None:
                if self.path != AWS_PATH:
                    self._send(404)
                    return
                with fake.lock:
                    fake.gets += 1
                    valid = self.headers.get("X-aws-ec2-metadata-token") in fake.tokens
                if not valid:
                    self._send(401)
                elif fake.notice.is_set():
                    self._send(200, json.dumps(
                        {"action": "terminate", "time": "2026-11-22T13:30:00Z"}).encode())
                else:
                    self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}{AWS_PATH}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       name="fake-aws", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def aws() -> Iterator[FakeAws]:
    fake = FakeAws()
    try:
        yield fake
    finally:
        fake.close()


def start_job(procs: Procs, out_path: Path, steps: int) -> int:
    """The counter, started by a shell that exits (as a launcher does): the job is nobody's
    child here, so nothing of the test holds its zombie when the drain stops it."""
    cmd = with_interval(workload("counter", "--steps", steps, "--mem-mib", MEM_MIB), INTERVAL)
    pid = start_detached(procs, cmd, out_path)
    wait_for_lines(out_path, 4)
    return pid


def events_of(daemon: Daemon) -> list[dict[str, Any]]:
    """``ckptctl --json events --last 100``: one JSON object per line."""
    res = daemon.ctl("events", "--last", "100")
    assert res.rc == 0, f"ckptctl events failed (exit {res.rc}): {res.err.strip()}"
    if isinstance(res.out, dict):  # exactly one line parses as a whole
        return [res.out]
    assert isinstance(res.out, str), res.out
    return [json.loads(line) for line in res.out.splitlines() if line.strip()]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (sample name, sorted labels) -> value."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def listening_tcp_inodes() -> set[str]:
    """Socket inodes of every TCP socket in LISTEN state (this network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A":  # TCP_LISTEN
                inodes.add(cols[9])
    return inodes


def socket_inodes_of(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def test_a_spot_notice_drains_the_protected_job_resume_restores_it_and_metrics_count_it(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, aws: FakeAws
) -> None:
    metrics_port = free_port()
    daemon = start_daemon(config={
        "spot_providers": "aws",
        "spot_aws_url": aws.url,
        "spot_poll_s": 0.3,
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    })
    wait_until(lambda: aws.gets >= 1, 10, "the daemon to poll the fake AWS metadata service")
    assert socket_inodes_of(daemon.pid) & listening_tcp_inodes(), (
        "with metrics_listen the daemon holds a listening TCP socket"
    )

    cmd = workload("counter", "--steps", STEPS, "--mem-mib", MEM_MIB)
    ref = reference(with_interval(cmd, 0))
    protected_out = tmp_path / "protected.out"
    other_out = tmp_path / "unprotected.out"
    protected = start_job(procs, protected_out, STEPS)
    other = start_job(procs, other_out, UNPROTECTED_STEPS)

    assert_ok(daemon.ctl("policy", "set", protected, "--name", "protected", "--on-term"),
              "policy set --on-term")
    assert is_alive(protected), "the protected job ended before the spot notice"

    aws.notice.set()
    wait_until(lambda: not is_alive(protected), 10,
               f"the protected job (pid {protected}) to be checkpointed and stopped")
    assert_running(other, "(unprotected) after the spot notice")

    policies = assert_ok(daemon.ctl("policy", "show"), "policy show")
    by_name = {p["name"]: p for p in policies}
    assert set(by_name) == {"protected"}, policies
    drained_id = by_name["protected"]["drained_checkpoint_id"]
    assert drained_id, f"no drained_checkpoint_id after the notice: {by_name['protected']}"
    assert by_name["protected"]["last_error"] == "", by_name["protected"]

    events = events_of(daemon)
    kinds = [e["kind"] for e in events]
    for kind in ("spot.notice", "drain", "checkpoint.committed"):
        assert kind in kinds, f"no {kind} event; kinds: {kinds}"
    notices = [e for e in events if e["kind"] == "spot.notice"]
    assert len(notices) == 1, notices
    assert "aws" in notices[0]["message"] and "terminate" in notices[0]["message"], notices
    drains = [e for e in events if e["kind"] == "drain"]
    assert len(drains) == 1 and drains[0]["fields"].get("drained") == 1, drains
    committed = [e for e in events if e["kind"] == "checkpoint.committed"]
    assert [e["checkpoint_id"] for e in committed] == [drained_id], committed
    assert committed[0]["pid"] == protected, committed
    assert kinds.index("spot.notice") < kinds.index("drain")

    # the notice persists: no second drain, no second notice
    time.sleep(1.5)
    assert [e["kind"] for e in events_of(daemon)].count("spot.notice") == 1
    assert_running(other, "(unprotected) while the notice persists")

    resumed = assert_ok(daemon.ctl("resume", "--all"), "resume --all")
    assert resumed["errors"] == [], resumed
    assert [r["id"] for r in resumed["restored"]] == [drained_id], resumed
    restored_pid = procs.add(resumed["restored"][0]["pid"])
    assert restored_pid == protected, "CRIU restores the job under its own pid"

    lines = wait_for_done(protected_out)
    assert lines == ref, "the protected job's whole output must equal an uninterrupted run's"
    after = assert_ok(daemon.ctl("policy", "show"), "policy show after resume")
    assert after[0]["drained_checkpoint_id"] == "", after

    samples = scrape(metrics_port)
    committed_total = samples[("ckptd_checkpoints_total", (("outcome", "committed"),))]
    assert committed_total >= 1, samples
    assert samples[("ckptd_spot_notices_total", ())] == 1
    assert samples[("ckptd_restores_total", (("outcome", "done"),))] >= 1
    assert samples[("ckptd_events_total", (("kind", "spot.notice"),))] == 1
    assert samples[("ckptd_events_total", (("kind", "drain"),))] == 1


def test_without_metrics_listen_there_is_no_metrics_endpoint(
    start_daemon: Callable[..., Daemon],
) -> None:
    port = free_port()
    daemon = start_daemon()
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
    # nor any TCP listener at all: its sockets are unix ones (no peer_listen either)
    listening = socket_inodes_of(daemon.pid) & listening_tcp_inodes()
    assert not listening, f"ckptd {daemon.pid} listens on TCP without metrics_listen"
    assert "metrics on" not in daemon.log()
