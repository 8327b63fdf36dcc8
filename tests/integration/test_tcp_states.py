"""TCP sockets in every state, IPv4 and IPv6 (issue 24, point 1): a job holding one is
checkpointed with what CRIU needs for its restore read from CRIU's own images (a socket its
peer reset is a connection there, TCP_CLOSE or not), and the restore brings it back: the job
continues exactly as an uninterrupted run (its output the same, bit for bit). ``check-restore``
names the connections the images hold. Before the fix a job holding a reset socket was dumped,
listed, said compatible, and every restore failed with CRIU's ``Connected TCP socket in
image``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .support import Daemon, Procs, assert_ok, proc_state, wait_until

pytestmark = pytest.mark.integration

STATE_JOB = Path(__file__).parent / "jobs" / "tcp_state.py"
STEPS = 6


def _start(procs: Procs, out: Path, state: str, family: str, interval_ms: int) -> int:
    with open(out, "wb") as stdout:
        proc = procs.popen(
            [sys.executable, str(STATE_JOB), state, family, str(STEPS), str(interval_ms)],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return proc.pid


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


# (the job's state, the TCP states CRIU's images hold)
STATES = {
    "reset": ["CLOSE"],
    "halfclosed": ["CLOSE_WAIT", "FIN_WAIT2"],
    "fin_wait1": ["ESTABLISHED", "FIN_WAIT1"],
    "last_ack": ["FIN_WAIT2", "LAST_ACK"],
    "time_wait": [],
}


@pytest.mark.parametrize("family", ["4", "6"])
@pytest.mark.parametrize("state", list(STATES))
def test_a_job_holding_a_tcp_socket_in_any_state_is_restored_and_continues_exactly(
    daemon: Daemon, procs: Procs, tmp_path: Path, state: str, family: str
) -> None:
    ref = tmp_path / "ref.txt"
    _start(procs, ref, state, family, interval_ms=0)
    wait_until(lambda: _lines(ref)[-1:] == ["done"], 30, "the reference run")
    out = tmp_path / "out.txt"
    pid = _start(procs, out, state, family, interval_ms=300)
    wait_until(lambda: len(_lines(out)) >= 2, 30, "the job's socket in its state")
    ck = assert_ok(daemon.ctl("dump", pid), "dump")
    assert ck["tcp_connections"] == len(STATES[state]) and not ck.get("tcp_close")
    wait_until(lambda: proc_state(pid) in (None, "Z"), 10, "the dumped job to die")
    procs.cleanup()
    report = assert_ok(daemon.ctl("check-restore", ck["id"]), "check-restore")
    assert report["compatible"] is True
    tcp_notes = [n for n in report["notes"] if "TCP" in n]
    if STATES[state]:
        (note,) = tcp_notes
        assert f"{len(STATES[state])} TCP connection(s) established" in note
        for name in STATES[state]:
            assert f"({name})" in note
    else:
        assert tcp_notes == []
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    wait_until(lambda: _lines(out)[-1:] == ["done"], 30, "the restored job to finish")
    assert out.read_bytes() == ref.read_bytes()
