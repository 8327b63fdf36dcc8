"""ckptctl's own gRPC client (``ckptd/transport/cli/wire.py``, issue 35) against grpcio's real
server on a unix socket: every outcome a call can have reaches the CLI as grpcio's client
would give it (the messages, the status code, the details, the trailing metadata), and the
HTTP/2 it speaks holds up where grpcio's server pushes it: large answers (flow control),
large trailers (CONTINUATION), many calls on one connection (HPACK's shared table), deadlines,
cancellations, a server that stops mid-call (GOAWAY) and one that is not HTTP/2 at all.

Its HPACK decoder is held to python-hyper's ``hpack`` on the blocks ``hpack``'s encoder makes,
Huffman-coded or not, indexed or not."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.transport.cli import headers, wire

SERVICE = "ckptd.v1.Checkpointer"


class Behaviour:
    """What the test server's methods do, set per test."""

    def __init__(self) -> None:
        self.list_delay = 0.0
        self.list_count = 1
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self.trailers: tuple[tuple[str, str | bytes], ...] = ()
        self.watch_started = threading.Event()
        self.watch_cancelled = threading.Event()


def _list(b: Behaviour) -> Any:
    def handler(request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        time.sleep(b.list_delay)
        if b.trailers:
            context.set_trailing_metadata(b.trailers)
        if b.fail:
            context.abort(*b.fail)
        return pb.ListResponse(checkpoints=[
            pb.Checkpoint(id=f"ck-{i:08d}", name=request.name or "x" * 100, pid=request.pid)
            for i in range(b.list_count)])
    return handler


def _watch(b: Behaviour) -> Any:
    def handler(request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        context.add_callback(b.watch_cancelled.set)
        for seq in range(request.backlog):
            yield pb.Event(seq=seq, kind="checkpoint.committed")
        b.watch_started.set()
        if request.follow:
            while context.is_active():
                time.sleep(0.02)
    return handler


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour, grpc.Server]]:
    behaviour = Behaviour()
    handlers = {
        "List": grpc.unary_unary_rpc_method_handler(
            _list(behaviour), request_deserializer=pb.ListRequest.FromString,
            response_serializer=pb.ListResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            _watch(behaviour), request_deserializer=pb.WatchRequest.FromString,
            response_serializer=pb.Event.SerializeToString),
    }
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    with tempfile.TemporaryDirectory(prefix="ckwire-") as d:
        path = str(Path(d) / "s.sock")
        srv.add_insecure_port("unix:" + path)
        srv.start()
        try:
            yield path, behaviour, srv
        finally:
            srv.stop(None)


def _stub(path: str) -> tuple[wire.Channel, Any]:
    channel = wire.Channel(path)
    return channel, wire.Stub(channel, pb.DESCRIPTOR.services_by_name["Checkpointer"], pb)


def test_unary_and_streaming_answers_arrive_whole(server: tuple[str, Behaviour, Any]) -> None:
    path, _behaviour, _ = server
    channel, stub = _stub(path)
    with channel:
        answer = stub.List(pb.ListRequest(pid=42, name="job"), timeout=10)
        assert [(c.id, c.name, c.pid) for c in answer.checkpoints] == [("ck-00000000", "job", 42)]
        events = list(stub.Watch(pb.WatchRequest(backlog=5), timeout=10))
        assert [e.seq for e in events] == [0, 1, 2, 3, 4]
        # many calls on one connection: HPACK's dynamic table shared across them
        for i in range(30):
            assert stub.List(pb.ListRequest(pid=i), timeout=10).checkpoints[0].pid == i


def test_an_answer_larger_than_every_window_and_frame(server: tuple[str, Behaviour, Any]
                                                       ) -> None:
    """A ~20 MiB answer: beyond the 64 KiB default windows, the 16 MiB point where the client
    gives its window back, and thousands of 16 KiB frames."""
    path, behaviour, _ = server
    behaviour.list_count = 200_000
    channel, stub = _stub(path)
    with channel:
        answer = stub.List(pb.ListRequest(), timeout=60)
        assert len(answer.checkpoints) == 200_000
        assert answer.ByteSize() > 20 << 20
        assert answer.checkpoints[-1].id == "ck-00199999"
        assert len(stub.List(pb.ListRequest(), timeout=60).checkpoints) == 200_000


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.FAILED_PRECONDITION])
def test_a_status_its_details_and_metadata(server: tuple[str, Behaviour, Any],
                                           code: grpc.StatusCode) -> None:
    """As grpcio's client gives them: the code, the details percent-decoded (non-ASCII and
    "%" included), text and binary trailing metadata, trailers past one frame
    (CONTINUATION)."""
    path, behaviour, _ = server
    details = "no checkpoint ck-x of pid 42: 100% gone — see `ckptctl list`"
    behaviour.fail = (code, details)
    behaviour.trailers = (("ckptd-error", "NotFound"), ("big", "v" * 40_000),
                          ("blob-bin", b"\x00\xff binary"))
    channel, stub = _stub(path)
    with channel, pytest.raises(wire.RpcError) as caught:
        stub.List(pb.ListRequest(), timeout=10)
    err = caught.value
    assert err.code().name == code.name
    assert err.details() == details
    metadata = dict(err.trailing_metadata())
    assert metadata["ckptd-error"] == "NotFound"
    assert metadata["big"] == "v" * 40_000
    assert metadata["blob-bin"] == b"\x00\xff binary"


def test_a_deadline_that_passes(server: tuple[str, Behaviour, Any]) -> None:
    path, behaviour, _ = server
    behaviour.list_delay = 2.0
    channel, stub = _stub(path)
    with channel:
        started = time.monotonic()
        with pytest.raises(wire.RpcError) as caught:
            stub.List(pb.ListRequest(), timeout=0.3)
        assert caught.value.code() is wire.StatusCode.DEADLINE_EXCEEDED
        assert caught.value.details() == "Deadline Exceeded"
        assert time.monotonic() - started < 1.5
        behaviour.list_delay = 0.0
        assert stub.List(pb.ListRequest(pid=7), timeout=10).checkpoints[0].pid == 7


def _following(stub: Any, backlog: int) -> tuple[Any, Iterator[pb.Event]]:
    """A following Watch and its iterator, its first event taken."""
    call = stub.Watch(pb.WatchRequest(backlog=backlog, follow=True), timeout=None)
    it = iter(call)
    assert next(it).seq == 0
    return call, it


def test_a_cancelled_stream_ends_on_the_server_and_the_channel_goes_on(
        server: tuple[str, Behaviour, Any]) -> None:
    path, behaviour, _ = server
    channel, stub = _stub(path)
    with channel:
        call, _it = _following(stub, backlog=2)
        assert behaviour.watch_started.wait(10)
        assert call.cancel()
        assert behaviour.watch_cancelled.wait(10), "the server never saw the cancellation"
        assert stub.List(pb.ListRequest(pid=3), timeout=10).checkpoints[0].pid == 3


def test_a_server_that_stops_mid_call(server: tuple[str, Behaviour, Any]) -> None:
    """The daemon stopping (grpcio's GOAWAY, then the connection closed) during a call: the
    words the CLI's "connection lost" line looks for."""
    path, _behaviour, srv = server
    channel, stub = _stub(path)
    with channel:
        _call, it = _following(stub, backlog=1)
        threading.Timer(0.2, lambda: srv.stop(0.1)).start()
        with pytest.raises(wire.RpcError) as caught:
            list(it)
    assert caught.value.code() in (wire.StatusCode.UNAVAILABLE, wire.StatusCode.CANCELLED)
    from ckptd.transport.cli.main import _CONNECTION_LOST
    assert _CONNECTION_LOST.search(caught.value.details()), caught.value.details()


def test_each_window_is_given_back_only_what_it_received() -> None:
    """Flow control across calls on one connection: 10 MiB on an abandoned stream, then
    20 MiB on the next: at every moment the connection has got back at most what it
    received, and each stream at most what it received (more overflows its window: the
    server's FLOW_CONTROL_ERROR). The frames go through the channel's own frame handling;
    the replies are read back."""
    channel = wire.Channel("/nonexistent")
    received: dict[int, int] = {1: 0, 3: 0}
    given: dict[int, int] = {0: 0, 1: 0, 3: 0}
    chunk = b"x" * 16384
    for stream, mib in ((1, 10), (3, 20)):
        channel._streams = {stream: wire._Stream()}
        for _ in range(mib * 64):
            replies: list[bytes] = []
            channel._take(wire.DATA, 0, stream, chunk, replies)
            received[stream] += len(chunk)
            for reply in replies:
                kind, target = reply[3], int.from_bytes(reply[5:9], "big")
                assert kind == wire.WINDOW_UPDATE
                given[target] += int.from_bytes(reply[9:13], "big")
            # at every moment, never more given back than received (on each window)
            assert given[0] <= received[1] + received[3], (given, received)
            assert given[1] <= received[1] and given[3] <= received[3], (given, received)
    assert given[0] > 0 and given[3] > 0


def test_nothing_listening_is_unavailable() -> None:
    with tempfile.TemporaryDirectory() as d:
        channel, stub = _stub(str(Path(d) / "none.sock"))
        with channel, pytest.raises(wire.RpcError) as caught:
            stub.List(pb.ListRequest(), timeout=5)
    assert caught.value.code() is wire.StatusCode.UNAVAILABLE
    assert "failed to connect to all addresses" in caught.value.details()


def test_a_peer_that_is_not_http2() -> None:
    """A line instead of HTTP/2 (the relay refusing this uid says one): UNAVAILABLE, the
    connection closed, nothing hangs."""
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "line.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def answer() -> None:
            conn, _ = listener.accept()
            conn.sendall(b"ckptd-relay: refused: uid 1000 has 8 connections open\n")
            time.sleep(0.5)
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        channel, stub = _stub(path)
        with channel, pytest.raises(wire.RpcError) as caught:
            stub.List(pb.ListRequest(), timeout=5)
        listener.close()
    assert caught.value.code() is wire.StatusCode.UNAVAILABLE
    assert "not HTTP/2" in caught.value.details() or "Socket closed" in caught.value.details()


HEADER_SETS = [
    [(b":status", b"200"), (b"content-type", b"application/grpc")],
    [(b"grpc-status", b"5"), (b"grpc-message", b"no such checkpoint %E2%80%94 ck-1"),
     (b"ckptd-error", b"NotFound"), (b"x-long", b"y" * 300)],
    [(b":status", b"200"), (b"grpc-accept-encoding", b"identity, deflate, gzip"),
     (b"custom-key", "ünïcode".encode())],
]


@pytest.mark.parametrize("huffman", [True, False])
def test_the_hpack_decoder_matches_hpacks_reference(huffman: bool) -> None:
    """hpack's encoder indexes into its dynamic table across blocks and Huffman-codes
    strings: our decoder reads every block back as hpack's own decoder does, including
    after a table size change (evictions)."""
    encoder, ours, theirs = hpack.Encoder(), headers.Decoder(), hpack.Decoder()
    for round_ in range(4):
        if round_ == 2:
            encoder.header_table_size = 256  # a size update at the next block's start
        for fields in HEADER_SETS:
            block = encoder.encode(fields, huffman=huffman)
            assert ours.decode(block) == fields == theirs.decode(block, raw=True)


def test_our_blocks_read_back_with_hpack_and_bad_blocks_are_refused() -> None:
    fields = [(b":method", b"POST"), (b":path", b"/ckptd.v1.Checkpointer/Dump"),
              (b"grpc-timeout", b"30000m"), (b"k", b"v" * 200)]
    assert hpack.Decoder().decode(headers.encode(fields), raw=True) == fields
    for bad in (b"\x80", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x00\x05abc",
                b"\x00\x81\x00\x00", b"\x3f\xe1\x3f"):
        with pytest.raises(headers.HeaderError):
            headers.Decoder().decode(bad)
