"""Issue 33 (7): a connection the daemon's relay refuses (the uid holds
``max_connections_per_uid`` connections already) is not "ckptd went away ... check that it
runs": the relay writes one line before it closes the connection, and ckptctl, its call
failed, reads it from a fresh connection (refused the same way) and prints it. The refusing
side here is a socket that does what the relay does for a refused uid (``refusal_line``);
the real relay, for a real unprivileged user: tests/integration/test_caller_limits.py."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.transport.cli import main as cli
from ckptd.transport.grpc.refusal import refusal_line, refusal_of

WHY = "uid 1000 holds 64 connections to ckptd already (max_connections_per_uid 64)"


@pytest.fixture
def refusing() -> Iterator[Path]:
    """A Unix socket whose every connection gets the relay's refusal line, then is closed."""
    with tempfile.TemporaryDirectory(prefix="ckctl-") as d:
        path = Path(d) / "ckptd.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(16)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    conn, _ = listener.accept()
                    with conn:
                        conn.send(refusal_line(WHY))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield path
        finally:
            stop.set()
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            thread.join(timeout=5)


def test_a_refused_connection_says_the_setting_and_what_to_do(
    capsys: pytest.CaptureFixture[str], refusing: Path
) -> None:
    for args in (["list"], ["dump", "42"]):
        code = cli.main(["--socket", str(refusing), *args])
        out, err = capsys.readouterr()
        assert code != 0 and out == ""
        assert err == (f"ckptctl: ckptd refused this connection: {WHY}; close some of them "
                       "(other ckptctl or clients of this uid still connected) and retry, or "
                       "raise it in the daemon's configuration\n"), err


def test_a_connection_that_is_served_or_absent_is_no_refusal(tmp_path: Path) -> None:
    assert refusal_of(str(tmp_path / "nothing.sock")) == ""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quiet:
        quiet.bind(str(tmp_path / "quiet.sock"))
        quiet.listen(1)  # accepted, never written to: the probe gives up at its timeout
        assert refusal_of(str(tmp_path / "quiet.sock"), timeout_s=0.2) == ""
