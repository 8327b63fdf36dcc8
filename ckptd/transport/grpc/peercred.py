"""Callers identified by the kernel: SO_PEERCRED on the public Unix socket.

gRPC's Python server does not expose a connection's peer credentials. So the daemon owns the
public socket itself: for every connection it reads SO_PEERCRED, then connects to the real gRPC
server (on a socket in a root-only directory) from a socket *bound to a path that encodes the
caller*: ``<peer_dir>/<uid>-<pid>-<n>``. gRPC reports that path as the peer, and
``caller_from_peer`` turns it back into a ``Caller``. Bytes are relayed unchanged.

Invariants: only root can bind in ``peer_dir`` or connect to the inner socket (both in 0700
directories), so a peer path there always comes from this proxy; a peer that is not from
``peer_dir`` is refused (no identity, no access).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import socket
import struct
import threading
from pathlib import Path

from ckptd.domain import Caller

log = logging.getLogger(__name__)

_PEER_RE = re.compile(r"^(\d+)-(\d+)-\d+$")


def caller_from_peer(peer: str, peer_dir: Path) -> Caller | None:
    """The caller a gRPC peer string stands for, or None if it is not one of ours."""
    if not peer.startswith("unix:"):
        return None
    path = Path(peer[len("unix:") :])
    if path.parent != peer_dir:
        return None
    match = _PEER_RE.match(path.name)
    if not match:
        return None
    return Caller(uid=int(match[1]), pid=int(match[2]))


class PeerCredProxy:
    def __init__(self, public: Path, inner: Path, peer_dir: Path, mode: int, gid: int) -> None:
        self._public = public
        self._inner = inner
        self._peer_dir = peer_dir
        self._counter = itertools.count(1)
        self._closing = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            public.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._listener.bind(str(public))
        finally:
            os.umask(old_umask)
        os.chown(public, 0, gid)
        os.chmod(public, mode)
        self._listener.listen(128)
        self._thread = threading.Thread(target=self._accept_loop, name="peercred", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting; connections already open go on until their RPCs end."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self._public.unlink()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return
                continue
            try:
                self._relay(conn)
            except OSError as exc:
                log.warning("cannot serve a connection: %s", exc)
                conn.close()

    def _relay(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        bound = self._peer_dir / f"{uid}-{pid}-{next(self._counter)}"
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.bind(str(bound))
            upstream.connect(str(self._inner))
        except OSError:
            upstream.close()
            with contextlib.suppress(FileNotFoundError):
                bound.unlink()
            raise
        pair = _Pair(conn, upstream, bound)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(
                target=pair.pump, args=(src, dst), name=f"relay-{uid}-{pid}", daemon=True
            ).start()


class _Pair:
    """Two sockets relayed both ways; closed (and the bound path removed) when both end."""

    def __init__(self, a: socket.socket, b: socket.socket, bound: Path) -> None:
        self._a, self._b, self._bound = a, b, bound
        self._open = 2
        self._lock = threading.Lock()

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(262144)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if last:
            self._a.close()
            self._b.close()
            with contextlib.suppress(FileNotFoundError):
                self._bound.unlink()
