"""sd_notify without libsystemd: notify() against real datagram sockets, watchdog_interval_s()
from the environment systemd gives a service."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.daemon import sdnotify

_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def path_listener(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> Iterator[tuple[socket.socket, str]]:
    """A SOCK_DGRAM socket bound to a file in tmp_path, named the way systemd names it."""
    path = tmp_path / "notify.sock"
    address = str(path)
    if len(address.encode()) > _SUN_PATH_MAX:  # a very deep tmp dir: bind relative to it
        clean_env.chdir(tmp_path)
        address = path.name
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(5)
        yield sock, address


@pytest.fixture
def abstract_listener(
    clean_env: pytest.MonkeyPatch,
) -> Iterator[tuple[socket.socket, str]]:
    """A SOCK_DGRAM socket on an abstract address; systemd writes those as "@name"."""
    name = f"ckptd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        yield sock, "@" + name


# notify ---------------------------------------------------------------------------------------


def test_notify_without_notify_socket_is_a_no_op(clean_env: pytest.MonkeyPatch) -> None:
    assert sdnotify.notify("READY=1") is False
    clean_env.setenv("NOTIFY_SOCKET", "")
    assert sdnotify.notify("READY=1") is False


def test_notify_sends_one_datagram_to_a_path_socket(
    path_listener: tuple[socket.socket, str], clean_env: pytest.MonkeyPatch
) -> None:
    sock, address = path_listener
    clean_env.setenv("NOTIFY_SOCKET", address)
    state = f"READY=1\nSTATUS=serving on /run/ckptd/ckptd.sock\nMAINPID={os.getpid()}"
    assert sdnotify.notify(state) is True
    assert sock.recv(4096) == state.encode()


def test_notify_each_call_is_its_own_datagram(
    path_listener: tuple[socket.socket, str], clean_env: pytest.MonkeyPatch
) -> None:
    sock, address = path_listener
    clean_env.setenv("NOTIFY_SOCKET", address)
    for state in ("WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"):
        assert sdnotify.notify(state) is True
    assert [sock.recv(4096) for _ in range(3)] == [b"WATCHDOG=1", b"WATCHDOG=1", b"STOPPING=1"]


def test_notify_to_an_abstract_address(
    abstract_listener: tuple[socket.socket, str], clean_env: pytest.MonkeyPatch
) -> None:
    sock, address = abstract_listener
    clean_env.setenv("NOTIFY_SOCKET", address)
    assert sdnotify.notify("WATCHDOG=1") is True
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_to_a_missing_socket_returns_false(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert sdnotify.notify("READY=1") is False
    clean_env.setenv("NOTIFY_SOCKET", f"@ckptd-test-absent-{uuid.uuid4().hex}")
    assert sdnotify.notify("READY=1") is False


def test_notify_to_a_socket_of_the_wrong_type_returns_false(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stream.sock"
    if len(str(path).encode()) > _SUN_PATH_MAX:
        pytest.skip("tmp_path too deep for an absolute AF_UNIX path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        stream.bind(str(path))
        stream.listen(1)
        clean_env.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify("READY=1") is False


# watchdog_interval_s ------------------------------------------------------------------------


def test_no_watchdog_without_watchdog_usec(clean_env: pytest.MonkeyPatch) -> None:
    assert sdnotify.watchdog_interval_s() is None
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() is None


def test_interval_is_half_the_timeout(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")  # WatchdogSec=30
    assert sdnotify.watchdog_interval_s() == pytest.approx(15.0)
    clean_env.setenv("WATCHDOG_USEC", "1500")
    assert sdnotify.watchdog_interval_s() == pytest.approx(0.00075)


def test_interval_when_watchdog_pid_is_this_process(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == pytest.approx(15.0)


def test_no_watchdog_when_meant_for_another_process(clean_env: pytest.MonkeyPatch) -> None:
    # a child that inherited the daemon's environment must not ping for it
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    clean_env.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval_s() is None


@pytest.mark.parametrize("usec", ["0", "-5", "thirty", "30s", "1.5e6", " "])
def test_no_watchdog_for_an_unusable_watchdog_usec(
    clean_env: pytest.MonkeyPatch, usec: str
) -> None:
    clean_env.setenv("WATCHDOG_USEC", usec)
    assert sdnotify.watchdog_interval_s() is None


def test_no_watchdog_for_an_unparsable_watchdog_pid(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    clean_env.setenv("WATCHDOG_PID", "self")
    assert sdnotify.watchdog_interval_s() is None


def test_empty_watchdog_pid_means_any_process(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    clean_env.setenv("WATCHDOG_PID", "")
    assert sdnotify.watchdog_interval_s() == pytest.approx(15.0)
