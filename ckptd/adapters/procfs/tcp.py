"""The TCP connections of a process tree, from /proc: each socket descriptor of the tree
matched, by inode, with its line in /proc/PID/net/tcp{,6} (the process's own network
namespace).

Only connected states are reported (listening sockets and ones never connected are not
connections; CRIU dumps those without ``--tcp-established``).
"""

from __future__ import annotations

import ipaddress
import os
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
}


def tcp_connections(proc: Path, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
    """Every connected TCP socket any process of ``tree`` holds, one per (pid, socket)."""
    found: list[TcpConnection] = []
    tables: dict[str, dict[int, tuple[str, str, str]]] = {}
    for fact in tree:
        inodes = list(_socket_inodes(proc / str(fact.pid) / "fd"))
        if not inodes:
            continue
        try:
            netns = os.readlink(proc / str(fact.pid) / "ns" / "net")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = _table(proc / str(fact.pid) / "net")
        table = tables[netns]
        for inode in sorted(set(inodes)):
            entry = table.get(inode)
            if entry is not None:
                local, remote, state = entry
                found.append(TcpConnection(fact.pid, fact.comm, local, remote, state, inode))
    return tuple(found)


def _socket_inodes(fd_dir: Path) -> Iterator[int]:
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            yield int(target[8:-1])


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
            if len(fields) < 10 or fields[3] not in _CONNECTED:
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
