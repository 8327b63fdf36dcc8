"""A real S3 API on loopback: moto's server, started once per test session.

``MotoServer.start()`` runs ``python -m moto.server`` on 127.0.0.1 with a free port, waits
until it answers, and ``stop()`` ends it (only that process). ``new_bucket()`` creates a
fresh bucket, so each test sees an empty store. Nothing here ever binds or connects to
anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

HOST = "127.0.0.1"
REGION = "us-east-1"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
}


def moto_missing() -> str | None:
    """Why the S3 contract tests cannot run here (None: they can)."""
    for module in ("moto", "flask", "boto3"):
        if importlib.util.find_spec(module) is None:
            return f"S3 contract tests need moto[server] ({module} is not installed)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class MotoServer:
    """``host``/``preexec_fn``: to serve inside a test's network namespace (its address
    there); then only processes in that namespace (or routed to it) reach it."""

    def __init__(
        self, log_dir: Path, host: str = HOST,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.host = host
        self.port = free_port() if host == HOST else 9000
        self.endpoint = f"http://{host}:{self.port}"
        self._log_path = log_dir / "moto_server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._preexec_fn = preexec_fn

    def start(self, timeout: float = 30.0) -> None:
        env = {**os.environ, **CREDENTIALS}
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=self._preexec_fn,  # noqa: PLW1509 (setns only)
            )
        if self._preexec_fn is not None:
            return  # not reachable from here: the caller waits from inside the namespace
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self._proc.returncode}: {self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint}: {self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def new_bucket(self) -> str:
        import boto3

        name = f"ckptd-{secrets.token_hex(6)}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=name)
        return name


class DroppingServer:
    """A TCP server on 127.0.0.1 that reads part of each request, then closes the connection
    without answering: every request sent to it fails, as against a dead or flaky endpoint."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((HOST, 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.endpoint = f"http://{HOST}:{self.port}"
        self.connections = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(1.0)
                with contextlib.suppress(OSError):
                    conn.recv(4096)  # some of the request, then hang up

    def stop(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def dropping_server() -> Iterator[DroppingServer]:
    server = DroppingServer()
    try:
        yield server
    finally:
        server.stop()


STORE_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}
"""obstore settings for moto (instead of the environment, which the tests leave alone)."""

_shared: dict[str, MotoServer] = {}
_shared_lock = threading.Lock()


def shared() -> MotoServer:
    """The session's moto server, started on first use (``stop_shared`` ends it)."""
    with _shared_lock:
        if "server" not in _shared:
            server = MotoServer(Path(tempfile.mkdtemp(prefix="ckptd-moto-")))
            server.start()
            _shared["server"] = server
        return _shared["server"]


def stop_shared() -> None:
    with _shared_lock:
        server = _shared.pop("server", None)
    if server is not None:
        server.stop()
