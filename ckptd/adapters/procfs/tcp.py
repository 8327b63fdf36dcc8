"""The TCP connections of a process tree, from /proc: each socket descriptor of the tree
matched, by inode, with its line in /proc/PID/net/tcp{,6} (the process's own network
namespace).

Every socket that has (or had) a peer is reported, in whatever state: established, half-closed
(FIN_WAIT1/2, CLOSE_WAIT, LAST_ACK, CLOSING), connecting (SYN_SENT), and closed by a reset
(TCP_CLOSE with its peer's address kept: CRIU dumps it as a connection and a restore needs
``--tcp-established`` for it). A reset socket is no longer in /proc/PID/net/tcp, so a socket
fd found in no table is looked at through a duplicate (``pidfd_getfd``): its ``TCP_INFO``
state and ``SO_PEERNAME``. Listening sockets and ones never connected are not connections
(CRIU dumps those without ``--tcp-established``); TIME_WAIT sockets have no descriptor.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptd.domain import ProcessFact, TcpConnection

_CONNECTED = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0B": "CLOSING",
    "07": "CLOSE",
}
_STATES = {int(code, 16): name for code, name in _CONNECTED.items()}
_SO_PEERNAME = 28
_CLONE_NEWNET = 0x40000000
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (since Linux 5.6)


def tcp_connections(proc: Path, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
    """Every connected TCP socket any process of ``tree`` holds, one per (pid, socket)."""
    found: list[TcpConnection] = []
    tables: dict[str, dict[int, tuple[str, str, str]]] = {}
    for fact in tree:
        fds = dict(_socket_fds(proc / str(fact.pid) / "fd"))
        if not fds:
            continue
        try:
            netns = os.readlink(proc / str(fact.pid) / "ns" / "net")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = _table(proc / str(fact.pid) / "net")
        table = tables[netns]
        for inode in sorted(set(fds.values())):
            entry = table.get(inode)
            if entry is None:  # a reset (TCP_CLOSE) socket is in no table: ask the socket
                fd = min(n for n, i in fds.items() if i == inode)
                entry = _closed_with_peer(fact.pid, fd, inode)
            if entry is not None:
                local, remote, state = entry
                found.append(TcpConnection(fact.pid, fact.comm, local, remote, state, inode))
    return tuple(found)


def _socket_fds(fd_dir: Path) -> Iterator[tuple[int, int]]:
    """(fd, socket inode) of every socket descriptor in ``fd_dir``."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:[") and name.isdigit():
            yield int(name), int(target[8:-1])


def _closed_with_peer(pid: int, fd: int, inode: int) -> tuple[str, str, str] | None:
    """(local, remote, "CLOSE") when ``pid``'s ``fd`` (socket ``inode``) is a TCP socket that
    a reset (or a failed connect) closed while it kept its peer's address; None for any other
    socket, or when it cannot be looked at (gone, or a kernel without pidfd_getfd)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    finally:
        os.close(pidfd)
    if dup < 0:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with sock:
        if (os.fstat(sock.fileno()).st_ino != inode or sock.type != socket.SOCK_STREAM
                or sock.proto not in (0, socket.IPPROTO_TCP)
                or sock.family not in (socket.AF_INET, socket.AF_INET6)):
            return None
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            peer = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERNAME,
                                   28 if sock.family == socket.AF_INET6 else 16)
            local = sock.getsockname()
        except OSError:  # ENOTCONN: never connected, no peer
            return None
        if _STATES.get(state) != "CLOSE":
            return None
        return _sockaddr(local), _raw_sockaddr(peer), "CLOSE"


def has_address(address: str, netns: Path | None = None) -> bool:
    """Whether the network namespace ``netns`` (a /proc/PID/ns/net; None: the daemon's) has
    the IP address of ``address`` (``ip:port``, ``[ipv6]:port``): a socket made there can
    bind it (no IP_FREEBIND, port 0). Another namespace is entered by a thread of its own
    (setns moves only the calling thread), so the daemon's threads never leave theirs; a
    namespace that cannot be entered has no address."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    family = socket.AF_INET6 if isinstance(ip, ipaddress.IPv6Address) else socket.AF_INET

    def bindable() -> bool:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((str(ip), 0))
            except OSError:
                return False
        return True

    if netns is None:
        return bindable()
    answer: list[bool] = []

    def in_netns() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                return
        finally:
            os.close(fd)
        answer.append(bindable())

    thread = threading.Thread(target=in_netns, name="ckptd-netns-address", daemon=True)
    thread.start()
    thread.join()
    return bool(answer) and answer[0]


def _sockaddr(addr: tuple[object, ...]) -> str:
    host = ipaddress.ip_address(str(addr[0]).split("%")[0])
    if isinstance(host, ipaddress.IPv6Address):
        mapped = host.ipv4_mapped
        return f"{mapped}:{addr[1]}" if mapped is not None else f"[{host}]:{addr[1]}"
    return f"{host}:{addr[1]}"


def _raw_sockaddr(raw: bytes) -> str:
    """A ``struct sockaddr_in``/``sockaddr_in6`` as ``ip:port`` (as ``_address`` shows them)."""
    (family,) = struct.unpack_from("=H", raw, 0)
    (port,) = struct.unpack_from("!H", raw, 2)
    if family == socket.AF_INET6:
        return _sockaddr((str(ipaddress.IPv6Address(raw[8:24])), port))
    return _sockaddr((str(ipaddress.IPv4Address(raw[4:8])), port))


def _table(net: Path) -> dict[int, tuple[str, str, str]]:
    """inode -> (local, remote, state) of every connected socket in /proc/PID/net/tcp{,6}."""
    table: dict[int, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] not in _CONNECTED or fields[2].endswith(":0000"):
                continue
            inode = int(fields[9])
            if inode:
                table[inode] = (_address(fields[1]), _address(fields[2]), _CONNECTED[fields[3]])
    return table


def _address(text: str) -> str:
    """``0100007F:1F90`` (kernel byte order, per 32-bit word) -> ``127.0.0.1:8080``;
    IPv6 as ``[::1]:8080``."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(ordered)
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        shown = str(mapped) if mapped is not None else f"[{address}]"
    else:
        shown = str(address)
    return f"{shown}:{int(port, 16)}"
