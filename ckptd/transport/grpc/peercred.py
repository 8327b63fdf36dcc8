"""Callers identified by the kernel: SO_PEERCRED on the public Unix socket.

gRPC's Python server does not expose a connection's peer credentials. So the daemon owns the
public socket itself: for every connection it reads SO_PEERCRED, then connects to the real gRPC
server (on a socket in a root-only directory) from a socket *bound to a path that encodes the
caller*: ``<peer_dir>/<uid>-<pid>-<start>-<n>``. gRPC reports that path as the peer, and
``caller_from_peer`` turns it back into a ``Caller``. Bytes are relayed unchanged.

The caller's process is pinned (issue 21): ``<start>`` is the start time of the very process
that connected, read while a pidfd on it says it is alive: the kernel's own pidfd of the
peer (``SO_PEERPIDFD``, Linux >= 6.5), else ``pidfd_open(pid)`` right after SO_PEERCRED;
``-1`` (``CALLER_GONE``) when that process had exited already. With the pid it names one
process, whatever later takes the pid; the core decides from the caller's process only
while that one is alive (``core.callers.caller_process``).

Invariants: only root can bind in ``peer_dir`` or connect to the inner socket (both in 0700
directories), so a peer path there always comes from this proxy; a peer that is not from
``peer_dir`` is refused (no identity, no access).

Bounded whatever the callers do: ONE thread relays every connection (non-blocking sockets
under ``selectors``), each direction holds at most ``CHUNK`` bytes in flight (a side is not
read while the other has not taken what it sent), and a uid other than root holds at most
``ConnectionLimits.per_uid`` connections, all of them together ``ConnectionLimits.total``
(root's are never refused), so threads stay constant and fds stay under
``2 * (total + root's)`` under a flood of idle connections.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import selectors
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ckptd.domain import Caller
from ckptd.domain.model import CALLER_GONE
from ckptd.transport.grpc.refusal import refusal_line

log = logging.getLogger(__name__)

_PEER_RE = re.compile(r"^(\d+)-(\d+)-(-1|\d+)-\d+$")

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
"""A pidfd on the process that connected a Unix socket (Linux >= 6.5; Python >= 3.13 names
it)."""


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
    return Caller(uid=int(match[1]), pid=int(match[2]), start_time=int(match[3]))


def caller_of(context: grpc.ServicerContext, peer_dir: Path) -> Caller:
    """The caller of a gRPC call through the relay; the call ends PERMISSION_DENIED when it
    is not one (a peer that did not come through ``peer_dir``)."""
    caller = caller_from_peer(context.peer(), peer_dir)
    if caller is None:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "caller could not be identified")
        raise AssertionError("unreachable: abort raises")
    return caller


def _alive(pidfd: int) -> bool:
    """The process of ``pidfd`` is not reaped (a zombie still holds its pid)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


def peer_start_time(conn: socket.socket, pid: int, proc: Path = Path("/proc")) -> int:
    """The start time (field 22 of /proc/PID/stat) of the process that connected ``conn``,
    whose SO_PEERCRED pid is ``pid``; ``CALLER_GONE`` when it has exited (or cannot be
    told); 0 when ``pid`` is 0 (a peer outside the daemon's pid namespace: no pid to pin).

    Invariant: the value is that process's own: the stat file is read while a pidfd on it
    says it is alive (a live process keeps its pid). The pidfd is the kernel's
    (``SO_PEERPIDFD``: the connecting process itself) where the kernel has it; else
    ``pidfd_open(pid)`` now, right after SO_PEERCRED (a process that exited and whose pid
    was taken in between would be missed; the kernel's pidfd leaves no such window)."""
    if pid <= 0:
        return 0
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:  # ENOPROTOOPT: a kernel before 6.5
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # ESRCH: gone already
            return CALLER_GONE
    try:
        if not _alive(pidfd):
            return CALLER_GONE
        raw = (proc / str(pid) / "stat").read_text()
        start = int(raw[raw.rindex(")") + 2:].split()[19])
        return start if _alive(pidfd) else CALLER_GONE
    except (OSError, ValueError, IndexError):
        return CALLER_GONE
    finally:
        os.close(pidfd)


CHUNK = 256 * 1024
"""Largest read from one side; also the most bytes held for the other side."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Connections the relay holds at once: ``per_uid`` for each uid but root, ``total`` for
    all of them together; root is never refused (its own tools, the node's admin)."""

    per_uid: int = 64
    total: int = 512


class PeerCredProxy:
    def __init__(self, public: Path, inner: Path, peer_dir: Path, mode: int, gid: int,
                 limits: ConnectionLimits | None = None) -> None:
        self._public = public
        self._inner = inner
        self._peer_dir = peer_dir
        self._limits = limits or ConnectionLimits()
        self._counter = itertools.count(1)
        self._closing = threading.Event()
        self._by_uid: Counter[int] = Counter()
        self._refused_logged = 0.0
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
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="peercred", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting; connections already open go on until their RPCs end."""
        self._closing.set()
        if self._thread.is_alive():  # else the loop has closed the pipe already
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self._public.unlink()

    def connections(self) -> dict[int, int]:
        """Connections held now, by uid (a copy; for tests and metrics)."""
        return dict(self._by_uid)

    # ---- the loop (the only thread) ------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing.is_set():
                for key, events in self._selector.select(timeout=1.0):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.data is not None:
                        key.data.ready(key.fileobj, events)
        except Exception:
            log.exception("the caller relay stopped")
        finally:
            self._close_listener()

    def _close_listener(self) -> None:
        """Stop accepting; relay what is open (daemon threads: the process ends them)."""
        for fileobj in (self._listener, self._wake_r):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fileobj)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(FileNotFoundError):
            self._public.unlink()
        if any(k.data is not None for k in self._selector.get_map().values()):
            threading.Thread(target=self._drain, name="peercred-drain", daemon=True).start()

    def _drain(self) -> None:
        while any(k.data is not None for k in self._selector.get_map().values()):
            for key, events in self._selector.select(timeout=1.0):
                if key.data is not None:
                    key.data.ready(key.fileobj, events)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: refuse this one, keep serving
                self._refused(f"cannot accept a connection: {exc}")
                time.sleep(0.01)
                return
            try:
                self._relay(conn)
            except OSError as exc:
                log.warning("cannot serve a connection: %s", exc)
                conn.close()

    def _refused(self, why: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged > 10.0:  # a flood logs one line per 10 s
            self._refused_logged = now
            log.warning("connection refused: %s", why)

    def _admit(self, uid: int) -> str:
        """Why a connection of ``uid`` is refused now ("" when it is not)."""
        if uid == 0:
            return ""
        if self._by_uid[uid] >= self._limits.per_uid:
            return (f"uid {uid} holds {self._by_uid[uid]} connections to ckptd already "
                    f"(max_connections_per_uid {self._limits.per_uid})")
        others = sum(n for u, n in self._by_uid.items() if u != 0)
        if others >= self._limits.total:
            return (f"users hold {others} connections to ckptd already (max_connections "
                    f"{self._limits.total})")
        return ""

    def _relay(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        why = self._admit(uid)
        if why:
            self._refused(why)
            with contextlib.suppress(OSError):  # said, never waited for: then closed
                conn.setblocking(False)
                conn.send(refusal_line(why))
            conn.close()
            return
        start = peer_start_time(conn, pid)
        bound = self._peer_dir / f"{uid}-{pid}-{start}-{next(self._counter)}"
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.bind(str(bound))
            upstream.settimeout(2.0)  # the inner server accepts at once; never wait longer
            upstream.connect(str(self._inner))
        except OSError:
            upstream.close()
            with contextlib.suppress(FileNotFoundError):
                bound.unlink()
            raise
        self._by_uid[uid] += 1
        _Pair(self._selector, conn, upstream, bound, lambda: self._release(uid))

    def _release(self, uid: int) -> None:
        self._by_uid[uid] -= 1
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]


class _Pair:
    """Two non-blocking sockets relayed both ways by the selector's thread: bytes read from
    one side wait in ``_pending[other]`` (at most CHUNK) and that side is not read again until
    they are sent; a side's end of file is passed on (shutdown) once its bytes are sent.
    Closed, its bound path removed and ``done`` called, when both sides have ended."""

    def __init__(self, selector: selectors.BaseSelector, a: socket.socket, b: socket.socket,
                 bound: Path, done: Callable[[], None]) -> None:
        self._sel = selector
        self._bound = bound
        self._done = done
        self._other = {a: b, b: a}
        self._pending: dict[socket.socket, bytes] = {a: b"", b: b""}
        self._eof: set[socket.socket] = set()
        self._closed = False
        for s in (a, b):
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ, self)

    def _want(self, s: socket.socket) -> None:
        """Register what ``s`` waits for now: reading while its peer's buffer is empty and
        it has not ended; writing while bytes wait for it."""
        events = 0
        if s not in self._eof and not self._pending[self._other[s]]:
            events |= selectors.EVENT_READ
        if self._pending[s]:
            events |= selectors.EVENT_WRITE
        key = self._sel.get_map().get(s)
        if events and key is None:
            self._sel.register(s, events, self)
        elif events and key is not None and key.events != events:
            self._sel.modify(s, events, self)
        elif not events and key is not None:
            self._sel.unregister(s)

    def ready(self, fileobj: object, events: int) -> None:
        s = fileobj
        assert isinstance(s, socket.socket)
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(s)
            if events & selectors.EVENT_READ and not self._closed:
                self._read(s)
        except OSError:
            self._close()
            return
        if self._closed:
            return
        if len(self._eof) == 2 and not any(self._pending.values()):
            self._close()
            return
        for side in self._other:
            self._want(side)

    def _read(self, src: socket.socket) -> None:
        dst = self._other[src]
        try:
            data = src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._eof.add(src)
            if not self._pending[dst]:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
            return
        self._pending[dst] = data
        self._flush(dst)

    def _flush(self, dst: socket.socket) -> None:
        data = self._pending[dst]
        if data:
            try:
                sent = dst.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            self._pending[dst] = data[sent:]
        if not self._pending[dst] and self._other[dst] in self._eof:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._other:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            s.close()
        with contextlib.suppress(FileNotFoundError):
            self._bound.unlink()
        self._done()
