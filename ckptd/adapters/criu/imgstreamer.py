"""CRIU's image-streamer protocol, served from an ``ImageSource``: a streamed restore.

The wire, as CRIU 4.2.1 speaks it (``criu/img-streamer.c``, ``criu/protobuf.c``; CRIU run with
``stream``, through RPC thanks to scripts/criu-patches/4.2.1):

- CRIU connects once to ``<images dir>/streamer-serve.sock`` (``AF_UNIX``, ``SOCK_STREAM``).
- For each image it opens: ``u32 length`` (host order) + ``ImgStreamerRequestEntry{filename}``.
- We answer ``u32 length`` + ``ImgStreamerReplyEntry{exists}``.
- If it exists, CRIU makes a pipe and sends us its *write* end: one byte with ``SCM_RIGHTS``.
  We write the image into it and close it; CRIU reads it in order (pages included: with
  ``stream`` every mapping is premapped and filled by ``read()``, no ``pread`` at offsets).
- CRIU closes the connection when it opens no more images.

Invariants: every image is written by a thread of its own (a pipe write waits until CRIU reads;
``close`` ends the waits); verified bytes are spliced into the pipe, not copied, and stay
referenced until CRIU has read them (``pipefeed.py``),
from ``ImageSource.chunks`` (verified bytes only, a few frames held per image: the memory is
bounded by the open images, not their size). A source failure is recorded (``error``) *before*
the pipe is closed short: CRIU then meets an early EOF and fails, and whatever reaches a hook
afterwards sees the error (the swrk adapter refuses the post-restore notification with it, so
CRIU kills what it created before any of it runs). CRIU closing its end early (it stopped
reading) is its own business, not an error here.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from google.protobuf.message import DecodeError

from ckptd._gen.criu import img_streamer_pb2
from ckptd.adapters.criu.pipefeed import PipeFeeder, Stopped
from ckptd.core.ports import CriuHooks, ImageSource
from ckptd.errors import CkptdError, CorruptCheckpoint

log = logging.getLogger(__name__)

SOCKET_NAME = "streamer-serve.sock"
"""Where CRIU's restore connects (``IMG_STREAMER_SERVE_SOCKET_NAME``)."""
LENGTH = struct.Struct("=I")
"""The length before each message (``pb_write_one``: a host-order u32)."""
MAX_MESSAGE = 1 << 16
PIPE_SIZE = 1 << 20
"""Asked for each image pipe (``F_SETPIPE_SZ``): fewer wake-ups than the default 64 KiB."""


class StreamProtocolError(Exception):
    """CRIU said something the protocol does not allow."""


def encode_message(message: img_streamer_pb2.img_streamer_reply_entry
                   | img_streamer_pb2.img_streamer_request_entry) -> bytes:
    """``message`` as ``pb_write_one`` frames it: its length, then it."""
    body = message.SerializeToString()
    return LENGTH.pack(len(body)) + body


def read_exactly(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes; None on a clean end before the first; StreamProtocolError mid-way."""
    buf = bytearray()
    while len(buf) < size:
        part = sock.recv(size - len(buf))
        if not part:
            if not buf:
                return None
            raise StreamProtocolError(f"connection closed {len(buf)} bytes into {size}")
        buf += part
    return bytes(buf)


def read_request(sock: socket.socket) -> str | None:
    """The next image name CRIU asks for; None when CRIU has closed the connection."""
    head = read_exactly(sock, LENGTH.size)
    if head is None:
        return None
    (size,) = LENGTH.unpack(head)
    if size > MAX_MESSAGE:
        raise StreamProtocolError(f"request of {size} bytes")
    body = read_exactly(sock, size) if size else b""
    if body is None:
        raise StreamProtocolError("connection closed after a request's length")
    request = img_streamer_pb2.img_streamer_request_entry()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise StreamProtocolError(f"request does not parse ({exc})") from exc
    if not request.IsInitialized() or not request.filename:
        raise StreamProtocolError("request without a file name")
    name = request.filename
    if not isinstance(name, str):  # a proto2 string that is not UTF-8 comes back as bytes
        raise StreamProtocolError(f"request for a file name that is not UTF-8 ({name[:64]!r})")
    return name


def send_reply(sock: socket.socket, exists: bool) -> None:
    sock.sendall(encode_message(img_streamer_pb2.img_streamer_reply_entry(exists=exists)))


def receive_fd(sock: socket.socket) -> int:
    """The pipe end CRIU sends after an ``exists`` reply (one byte, one ``SCM_RIGHTS`` fd)."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * fds.itemsize),
                                             socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(data) != 1 or len(fds) != 1 or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise StreamProtocolError(f"expected one byte and one descriptor, got {len(data)} "
                                  f"bytes and {len(fds)} descriptors")
    return fds[0]




class ImageStreamer:
    """Serves ``source`` to one CRIU restore at ``images_dir/streamer-serve.sock``.

    ``start`` before CRIU is asked to restore; ``close`` after CRIU has exited (it joins the
    writers: each ends when its image is written or CRIU's end of its pipe is gone). ``error``:
    the first failure of the source or the protocol, None if there was none."""

    def __init__(self, images_dir: Path, source: ImageSource, *, pipe_size: int = PIPE_SIZE
                 ) -> None:
        self.source = source
        self._pipe_size = pipe_size
        self._lock = threading.Lock()
        self._error: CkptdError | None = None
        self._conn: socket.socket | None = None
        self._writers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._retained: list[memoryview] = []
        """Chunks a failed writer had spliced into a pipe CRIU may still read: let go at close."""
        self.served: list[str] = []
        """Every image CRIU asked for that exists, in the order asked."""
        self.missing: list[str] = []
        """Every image CRIU asked for that does not exist (CRIU takes it as empty)."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        dir_fd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # through the directory's descriptor: no limit on the directory's path length
            self._listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}")
        finally:
            os.close(dir_fd)
        self.path = images_dir / SOCKET_NAME
        os.chmod(self.path, 0o600)
        self._listener.listen(1)
        self._thread = threading.Thread(target=self._serve, name="img-streamer", daemon=True)

    @property
    def error(self) -> CkptdError | None:
        with self._lock:
            return self._error

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop listening, end the connection, and end the writers (one still waiting for
        CRIU to read gives up: call this once CRIU has exited)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout)
        for writer in list(self._writers):
            writer.join(timeout)
            if writer.is_alive():
                log.warning("image streamer: %s still writing after %.0fs", writer.name,
                            timeout)
        with self._lock:
            self._retained.clear()  # CRIU has exited: no pipe refers to them any more
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _fail(self, error: CkptdError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # closed before CRIU connected (it failed first, or never streamed)
        with self._lock:
            self._conn = conn
        try:
            while (name := read_request(conn)) is not None:
                exists = self.source.exists(name)
                send_reply(conn, exists)
                if not exists:
                    self.missing.append(name)
                    continue
                self.served.append(name)
                fd = receive_fd(conn)
                writer = threading.Thread(target=self._write_image, args=(name, fd),
                                          name=f"img-streamer {name}", daemon=True)
                self._writers.append(writer)
                writer.start()
        except (OSError, StreamProtocolError) as exc:
            if self._thread_closing(exc):
                return
            self._fail(CorruptCheckpoint(
                f"checkpoint {self.source.checkpoint_id}: the image streamer's connection "
                f"with CRIU failed ({exc})", checkpoint_id=self.source.checkpoint_id))
            log.warning("image streamer: %s", exc)
        finally:
            conn.close()

    def _thread_closing(self, exc: BaseException) -> bool:
        """An error that only says ``close`` ended the connection."""
        return isinstance(exc, OSError) and self._listener.fileno() == -1

    def _write_image(self, name: str, fd: int) -> None:
        """Write image ``name`` into the pipe ``fd``; on a source failure record it, then
        close the pipe short (CRIU meets an early EOF)."""
        feeder: PipeFeeder | None = None
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, self._pipe_size)
            os.set_blocking(fd, False)
            feeder = PipeFeeder(fd, self._stopping)  # verified bytes spliced, not copied
            for chunk in self.source.chunks(name):
                feeder.feed(chunk)
            feeder.finish()
        except BrokenPipeError:
            log.debug("image streamer: CRIU closed %s before its end", name)
        except Stopped:
            log.warning("image streamer: %s abandoned unread (CRIU has ended)", name)
        except CkptdError as exc:
            self._fail(exc)
            log.warning("image streamer: %s: %s", name, exc.message)
        except Exception as exc:  # a source that fails otherwise: still never half an image
            error = CorruptCheckpoint(
                f"checkpoint {self.source.checkpoint_id}: image {name} could not be read "
                f"({type(exc).__name__}: {exc})", checkpoint_id=self.source.checkpoint_id)
            error.__cause__ = exc
            self._fail(error)
            log.exception("image streamer: %s", name)
        finally:
            if feeder is not None:  # what the pipe may still hold: kept until CRIU has exited
                with self._lock:
                    self._retained.extend(feeder.unreleased())
            os.close(fd)


class StreamGuard(CriuHooks):
    """The caller's hooks, plus: refuse post-restore and pre-resume (CRIU then kills the
    tree, which has not run) once the image streamer has failed. Its error is recorded
    before the pipe it concerns is closed short, so CRIU cannot get past an incomplete image
    to these notifications without the guard seeing it."""

    def __init__(self, inner: CriuHooks, streamer: ImageStreamer) -> None:
        self._inner = inner
        self._streamer = streamer

    def _check(self) -> None:
        error = self._streamer.error
        if error is not None:
            raise error

    def criu_started(self, criu_pid: int) -> None:
        self._inner.criu_started(criu_pid)

    def pre_restore(self, pid: int) -> None:
        self._inner.pre_restore(pid)

    def setup_namespaces(self, pid: int) -> None:
        self._inner.setup_namespaces(pid)

    def post_restore(self, pid: int) -> None:
        self._check()
        self._inner.post_restore(pid)

    def pre_resume(self, pid: int) -> None:
        self._check()
        self._inner.pre_resume(pid)

    def post_resume(self, pid: int) -> None:
        self._inner.post_resume(pid)
