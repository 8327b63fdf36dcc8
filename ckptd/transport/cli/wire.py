"""``ckptctl``'s gRPC client: the calls it makes, over HTTP/2 (RFC 9113) on the daemon's unix
socket, written here instead of grpcio (issue 35, the small job).

Why not grpcio here: ``ckptctl dump PID`` of a small job is mostly the CLI's start-up, and
importing grpcio (its C core and asyncio) is ~40 ms of it; python-hyper's ``h2`` ~12 ms, its
``hyperframe`` and ``hpack`` ~5 ms each; this module and ``headers.py`` (HPACK) ~2 ms. The
daemon, the library client (``ckptd.client``) and the peer links keep grpcio: this module
serves only the short-lived CLI, which makes one call at a time on one connection, as an
HTTP/2 client that asks for nothing optional (no push, no priority, no compression).

What it speaks (the gRPC over HTTP/2 protocol, as grpcio's server answers it):

- one connection per :class:`Channel`, opened at the first call; each call is a new stream:
  ``POST /<service>/<method>``, ``content-type: application/grpc``, ``te: trailers``,
  ``grpc-timeout`` from the call's timeout; the request is one length-prefixed message
  (uncompressed: no ``grpc-accept-encoding`` is sent, so the server compresses nothing);
- the answer: headers (``:status`` 200), messages, then trailers with ``grpc-status`` and
  ``grpc-message`` (percent-encoded); or a trailers-only answer. A non-OK status raises
  :class:`RpcError` with the code, the details and the trailing metadata (``-bin`` values
  decoded from base64), as grpcio's ``RpcError`` offers them (``code()``, ``details()``,
  ``trailing_metadata()``), so the CLI's error lines are the same;
- a deadline: the server is told (``grpc-timeout``) and the client stops waiting at it
  (DEADLINE_EXCEEDED, "Deadline Exceeded", the stream reset);
- a socket that cannot be reached: UNAVAILABLE "failed to connect to all addresses"; a
  connection that breaks mid-call (the daemon killed, GOAWAY, EOF): UNAVAILABLE "Socket
  closed" / "GOAWAY received", the words the CLI's "connection lost" line looks for;
- HTTP/2 itself: the preface and SETTINGS (acknowledged both ways), PING answered, the
  server's MAX_FRAME_SIZE and windows obeyed when sending, receive windows large and every
  byte received acknowledged before they run low, header blocks across CONTINUATION frames
  decoded in order for every stream (they share HPACK's table), padding removed; a frame
  that breaks the protocol closes the connection (UNAVAILABLE); a message larger than
  MAX_MESSAGE is refused (RESOURCE_EXHAUSTED), as grpcio's client limit is.

Invariants: a call's iterator yields only whole messages of the call's stream; a call
abandoned part-way (the iterator dropped, :meth:`Call.cancel`) has its stream reset before the
next call on the channel; :meth:`Channel.close` closes the socket whatever state it is in.
"""

from __future__ import annotations

import contextlib
import enum
import math
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from ckptd.transport.cli import headers as hpack

MAX_MESSAGE = 64 << 20
"""The largest response message taken (bytes)."""
WINDOW = (1 << 31) - 1
"""The receive window asked for, per stream and for the connection."""
DEFAULT_WINDOW = 65535
"""Every window's size before SETTINGS say otherwise (RFC 9113 6.9.2)."""
ACK_AFTER = 1 << 24
"""Received bytes given back (WINDOW_UPDATE) once this many are used of a window."""
_PREFIX = struct.Struct(">BI")
_FRAME = struct.Struct(">HBBBI")  # length (24 bits: 16 + 8), type, flags, stream id
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
REFUSED_STREAM = 0x7
CANCEL = 0x8
ENHANCE_YOUR_CALM = 0xB


class StatusCode(enum.Enum):
    """gRPC's status codes (the names grpcio's ``StatusCode`` has)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


_HTTP_CODES = {400: StatusCode.INTERNAL, 401: StatusCode.UNAUTHENTICATED,
               403: StatusCode.PERMISSION_DENIED, 404: StatusCode.UNIMPLEMENTED,
               429: StatusCode.UNAVAILABLE, 502: StatusCode.UNAVAILABLE,
               503: StatusCode.UNAVAILABLE, 504: StatusCode.UNAVAILABLE}
"""gRPC's mapping of an HTTP status other than 200 to a code."""

Metadata = tuple[tuple[str, "str | bytes"], ...]


class RpcError(Exception):
    """A call that ended without OK: ``code()``, ``details()``, ``trailing_metadata()``."""

    def __init__(self, code: StatusCode, details: str, metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._metadata = metadata

    def code(self) -> StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._metadata


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...


_M = TypeVar("_M")


def _percent_decoded(raw: bytes) -> str:
    """``grpc-message``'s percent-encoding undone (invalid escapes kept as they are)."""
    if b"%" not in raw:
        return raw.decode("utf-8", "replace")
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x25 and _is_hex(raw[i + 1:i + 3]):
            out.append(int(raw[i + 1:i + 3], 16))
            i += 3
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "replace")


def _is_hex(two: bytes) -> bool:
    return len(two) == 2 and all(c in b"0123456789abcdefABCDEF" for c in two)


def _timeout_header(timeout: float) -> bytes:
    """``grpc-timeout``: at most 8 digits, in milliseconds or, beyond, seconds or hours."""
    ms = max(1, math.ceil(timeout * 1000))
    if ms < 10**8:
        return b"%dm" % ms
    seconds = math.ceil(timeout)
    return b"%dS" % seconds if seconds < 10**8 else b"%dH" % min(math.ceil(seconds / 3600),
                                                                  10**8 - 1)


def _metadata(headers: list[tuple[bytes, bytes]]) -> Metadata:
    items: list[tuple[str, str | bytes]] = []
    for key, value in headers:
        name = key.decode("ascii", "replace")
        if name.startswith(":") or name in ("grpc-status", "grpc-message", "content-type"):
            continue
        if name.endswith("-bin"):
            import base64  # (rare: only binary metadata needs it)

            items.append((name, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            items.append((name, value.decode("utf-8", "replace")))
    return tuple(items)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    size = len(payload)
    return _FRAME.pack(size >> 8, size & 0xFF, kind, flags, stream) + payload


class ProtocolError(Exception):
    """The server broke HTTP/2 (or is not an HTTP/2 server)."""


class _Stream:
    """What one call has received: header blocks' fields, message bytes, whether it ended."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.data = bytearray()
        self.ended = False
        self.reset: int | None = None
        self.goaway = ""
        self.send_window = DEFAULT_WINDOW
        self.unacked = 0
        """Bytes received on this stream not yet given back (WINDOW_UPDATE)."""


class Channel:
    """One HTTP/2 connection to the unix socket ``path``, opened at the first call; calls
    are made one at a time (a new stream each)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._new_connection()

    def _new_connection(self) -> None:
        """The state of a connection not yet opened (every connection starts from it)."""
        self._open: Call[Any] | None = None
        self._streams: dict[int, _Stream] = {}
        self._next_stream = 1
        self._inbox = bytearray()
        self._decoder = hpack.Decoder()
        self._block: tuple[int, int, bytearray] | None = None  # stream, flags, fragments
        self._max_frame = 16384
        self._send_window = DEFAULT_WINDOW
        self._stream_window = DEFAULT_WINDOW
        self._unacked = 0
        """Bytes received on the connection not yet given back (WINDOW_UPDATE)."""
        self._goaway = ""
        """What the server's GOAWAY said ("": none): no new call on this connection."""

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        sock, self._sock = self._sock, None
        self._new_connection()
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise RpcError(StatusCode.UNAVAILABLE,
                           f"failed to connect to all addresses; last error: unix:{self.path}: "
                           f"{exc.strerror or exc}") from exc
        self._sock = sock
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0,
                               SETTINGS_INITIAL_WINDOW_SIZE, WINDOW)
        self._send(PREFACE + frame(SETTINGS, 0, 0, settings)
                   + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", WINDOW - DEFAULT_WINDOW)))
        return sock

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise RpcError(StatusCode.UNAVAILABLE, "Socket closed")
        try:
            sock.sendall(data)
        except OSError as exc:
            raise self._broken(f"Socket closed ({exc.strerror or exc})", exc) from exc

    def _broken(self, details: str, cause: BaseException | None = None) -> RpcError:
        self.close()
        error = RpcError(StatusCode.UNAVAILABLE, details)
        error.__cause__ = cause
        return error

    def call(self, method: str, request: Message, parse: Callable[[bytes], _M],
             timeout: float | None) -> Call[_M]:
        """Start the call ``method`` (``/package.Service/Method``) with ``request``; its
        response messages are ``parse``d."""
        if self._open is not None:
            self._open.cancel()
        if self._goaway:
            self.close()
        self._connect()
        stream = self._next_stream
        self._next_stream += 2
        fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
                  (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
                  (b"te", b"trailers"), (b"user-agent", b"ckptctl")]
        if timeout is not None:
            fields.append((b"grpc-timeout", _timeout_header(timeout)))
        state = _Stream()
        state.send_window = self._stream_window
        self._streams[stream] = state
        call: Call[_M] = Call(self, stream, state, parse, timeout)
        self._open = call
        block = hpack.encode(fields)
        body = request.SerializeToString()
        try:
            self._send_block(stream, block)
            call.send(_PREFIX.pack(0, len(body)) + body)
        except BaseException:
            call.cancel()
            raise
        return call

    def _send_block(self, stream: int, block: bytes) -> None:
        first, rest = block[:self._max_frame], block[self._max_frame:]
        out = [frame(HEADERS, 0 if rest else END_HEADERS, stream, first)]
        while rest:
            part, rest = rest[:self._max_frame], rest[self._max_frame:]
            out.append(frame(CONTINUATION, 0 if rest else END_HEADERS, stream, part))
        self._send(b"".join(out))

    def unary(self, method: str, request: Message, parse: Callable[[bytes], _M],
              timeout: float | None) -> _M:
        """The call's one response message."""
        answers = list(self.call(method, request, parse, timeout))
        if len(answers) != 1:
            raise RpcError(StatusCode.INTERNAL,
                           f"{len(answers)} messages answered a unary call {method}")
        return answers[0]

    def _ended(self, call: Call[Any]) -> None:
        if self._open is call:
            self._open = None

    def reset(self, stream: int) -> None:
        """Reset ``stream`` (CANCEL) and forget it."""
        self._streams.pop(stream, None)
        if self._sock is not None:
            try:
                self._sock.sendall(frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
            except OSError:
                self.close()

    def receive(self, deadline: float | None) -> None:
        """Read what the server sent once (until ``deadline``) and take its frames."""
        sock = self._sock
        if sock is None:
            raise RpcError(StatusCode.UNAVAILABLE, "Socket closed")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise
        except OSError as exc:
            raise self._broken(f"Socket closed ({exc.strerror or exc})", exc) from exc
        if not data:
            raise self._broken("Socket closed")
        self._inbox += data
        replies: list[bytes] = []
        try:
            while len(self._inbox) >= _FRAME.size:
                high, low, kind, flags, stream = _FRAME.unpack_from(self._inbox)
                size = (high << 8) | low
                if size > 16384:  # SETTINGS_MAX_FRAME_SIZE: the default, never raised
                    raise ProtocolError(f"a frame of {size} bytes")
                if len(self._inbox) < _FRAME.size + size:
                    break
                payload = bytes(self._inbox[_FRAME.size:_FRAME.size + size])
                del self._inbox[:_FRAME.size + size]
                self._take(kind, flags, stream & 0x7FFFFFFF, payload, replies)
        except (ProtocolError, hpack.HeaderError, struct.error) as exc:
            raise self._broken(f"Socket closed (not HTTP/2 as gRPC speaks it: {exc})",
                               exc) from exc
        if replies:
            self._send(b"".join(replies))

    def _take(self, kind: int, flags: int, stream: int, payload: bytes,
              replies: list[bytes]) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise ProtocolError("a header block interrupted")
        if kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
                replies.append(frame(SETTINGS, ACK, 0))
        elif kind == PING:
            if not flags & ACK:
                replies.append(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            (increment,) = struct.unpack(">I", payload)
            if stream == 0:
                self._send_window += increment & 0x7FFFFFFF
            elif stream in self._streams:
                self._streams[stream].send_window += increment & 0x7FFFFFFF
        elif kind == GOAWAY:  # streams up to ``last`` still finish; no new ones here
            last, code = struct.unpack_from(">II", payload)
            why = payload[8:].decode("utf-8", "replace").strip()
            self._goaway = f"GOAWAY received (error code {code}{': ' + why if why else ''})"
            for number, refused in self._streams.items():
                if number > last & 0x7FFFFFFF:
                    refused.ended = True
                    refused.goaway = self._goaway
        elif kind == RST_STREAM:
            reset = self._streams.get(stream)
            if reset is not None:
                (reset.reset,) = struct.unpack(">I", payload)
                reset.ended = True
        elif kind in (HEADERS, CONTINUATION):
            self._header_frame(kind, flags, stream, payload)
        elif kind == DATA:
            self._data(flags, stream, payload, replies)
        elif kind == PUSH_PROMISE:
            raise ProtocolError("PUSH_PROMISE, push being off")
        # PRIORITY and unknown frame types are ignored (RFC 9113 4.1, 5.5)

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ProtocolError("a SETTINGS frame of a bad length")
        for at in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, at)
            if key == SETTINGS_MAX_FRAME_SIZE:
                self._max_frame = value
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                change = value - self._stream_window
                self._stream_window = value
                for state in self._streams.values():
                    state.send_window += change

    @staticmethod
    def _unpadded(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError("bad padding")
        return payload[1:len(payload) - payload[0]]

    def _header_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == HEADERS:
            payload = self._unpadded(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._block = (stream, flags, bytearray(payload))
        else:
            if self._block is None or self._block[0] != stream:
                raise ProtocolError("a CONTINUATION out of place")
            self._block[2].extend(payload)
        if not flags & END_HEADERS:
            return
        stream, first_flags, block = self._block
        self._block = None
        fields = self._decoder.decode(bytes(block))  # every block: they share the table
        state = self._streams.get(stream)
        if state is None:
            return
        if not state.headers:
            state.headers = fields
        else:
            state.trailers = fields
        if first_flags & END_STREAM:
            state.ended = True

    def _data(self, flags: int, stream: int, payload: bytes, replies: list[bytes]) -> None:
        """A DATA frame: its bytes (padding included) count against the connection's window
        and its stream's; each is given back what was received on it, once 16 MiB of its
        2 GiB are used (a stream only while it is open: never more than it received)."""
        self._unacked += len(payload)
        state = self._streams.get(stream)
        if state is not None:
            state.data += self._unpadded(flags, payload)
            state.unacked += len(payload)
            if flags & END_STREAM:
                state.ended = True
            elif state.unacked >= ACK_AFTER:
                replies.append(frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", state.unacked)))
                state.unacked = 0
        if self._unacked >= ACK_AFTER:
            replies.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._unacked)))
            self._unacked = 0


class Call(Generic[_M]):
    """One call's stream: iterate for its response messages; ``cancel()`` resets it."""

    def __init__(self, channel: Channel, stream: int, state: _Stream,
                 parse: Callable[[bytes], _M], timeout: float | None) -> None:
        self._channel = channel
        self._stream = stream
        self._state = state
        self._parse = parse
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._done = False

    def cancel(self) -> bool:
        """Reset the stream (CANCEL) unless it has ended; True when it was reset."""
        if self._done:
            return False
        self._done = True
        self._channel._ended(self)
        self._channel.reset(self._stream)
        return True

    def send(self, data: bytes) -> None:
        """Send ``data`` on the stream, then end it, as the windows allow."""
        channel = self._channel
        view = memoryview(data)
        while True:
            room = min(channel._send_window, self._state.send_window, channel._max_frame,
                       len(view))
            if room or not view:
                channel._send_window -= room
                self._state.send_window -= room
                last = room == len(view)
                channel._send(frame(DATA, END_STREAM if last else 0, self._stream,
                                    view[:room].tobytes()))
                view = view[room:]
                if last:
                    return
            else:
                self._wait()  # a window update lets more go

    def _wait(self) -> None:
        try:
            self._channel.receive(self._deadline)
        except TimeoutError:
            raise self._fail(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def __iter__(self) -> Iterator[_M]:
        try:
            while True:
                message = self._take_message()
                if message is not None:
                    yield self._parse(message)
                    continue
                if self._state.ended:
                    self._finish()
                    return
                self._wait()
        finally:
            if not self._done:
                self.cancel()

    def _take_message(self) -> bytes | None:
        data = self._state.data
        if len(data) < _PREFIX.size:
            return None
        compressed, size = _PREFIX.unpack_from(data)
        if compressed:
            raise self._fail(StatusCode.INTERNAL, "a compressed message was not asked for")
        if size > MAX_MESSAGE:
            raise self._fail(StatusCode.RESOURCE_EXHAUSTED,
                             f"Received message larger than max ({size} vs. {MAX_MESSAGE})")
        end = _PREFIX.size + size
        if len(data) < end:
            return None
        message = bytes(data[_PREFIX.size:end])
        del data[:end]
        return message

    def _fail(self, code: StatusCode, details: str) -> RpcError:
        self.cancel()
        return RpcError(code, details)

    def _reset_error(self, code: int) -> RpcError:
        """The server reset the stream. grpcio's server does so when the call's deadline
        passes (NO_ERROR) and, stopping, for every open call, its GOAWAY right behind (read
        here if it comes within 0.1 s): DEADLINE_EXCEEDED, UNAVAILABLE with the GOAWAY's
        words, else gRPC's mapping of the reset's code."""
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return RpcError(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if code == CANCEL:
            return RpcError(StatusCode.CANCELLED, "Stream removed (cancelled by the server)")
        if not self._channel._goaway:
            with contextlib.suppress(TimeoutError, RpcError):
                self._channel.receive(time.monotonic() + 0.1)
        if self._channel._goaway:
            return RpcError(StatusCode.UNAVAILABLE, self._channel._goaway)
        mapped = {REFUSED_STREAM: StatusCode.UNAVAILABLE,
                  ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED}.get(code, StatusCode.INTERNAL)
        return RpcError(mapped, f"Stream removed (reset by the server, error code {code})")

    def _finish(self) -> None:
        """The ended stream's status: raised unless OK."""
        state = self._state
        self._done = True
        self._channel._ended(self)
        self._channel._streams.pop(self._stream, None)
        if state.goaway:
            raise RpcError(StatusCode.UNAVAILABLE, state.goaway)
        if state.reset is not None:
            raise self._reset_error(state.reset)
        head = dict(state.headers)
        status = head.get(b":status", b"")
        if status != b"200":
            code = _HTTP_CODES.get(int(status) if status.isdigit() else 0, StatusCode.UNKNOWN)
            raise RpcError(code, f"HTTP status {status.decode(errors='replace') or 'missing'}")
        fields = state.trailers if state.trailers is not None else state.headers
        named = dict(fields)
        raw = named.get(b"grpc-status")
        if raw is None:
            raise RpcError(StatusCode.UNKNOWN, "the server ended the call without a status")
        try:
            code = StatusCode(int(raw))
        except ValueError:
            code = StatusCode.UNKNOWN
        if code is not StatusCode.OK:
            raise RpcError(code, _percent_decoded(named.get(b"grpc-message", b"")),
                           _metadata(fields))
        if state.data:
            raise RpcError(StatusCode.INTERNAL, "the call ended inside a message")


class Stub:
    """A service's methods as attributes, from its descriptor: ``stub.Dump(request,
    timeout=...)`` returns the response message of a unary method and an iterable
    :class:`Call` of a server-streaming one."""

    def __init__(self, channel: Channel, service: Any, messages: Any) -> None:
        self._channel = channel
        self._methods = {m.name: m for m in service.methods}
        self._service = service.full_name
        self._messages = messages

    def __getattr__(self, name: str) -> Callable[..., Any]:
        methods = self.__dict__.get("_methods", {})
        if name not in methods:
            raise AttributeError(name)
        method = methods[name]
        path = f"/{self._service}/{name}"
        parse = getattr(self._messages, method.output_type.name).FromString

        def invoke(request: Message, timeout: float | None = None) -> Any:
            if method.server_streaming:
                return self._channel.call(path, request, parse, timeout)
            return self._channel.unary(path, request, parse, timeout)

        return invoke
