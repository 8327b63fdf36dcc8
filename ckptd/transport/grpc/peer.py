"""The Peer service between daemons (gRPC over TCP, mutual TLS): its servicer, over the core's
``Receiver``, and its client, the core's ``PeerConnector`` port.

Only the Peer service is served on TCP; the Checkpointer API stays on the Unix socket. The
server requires a client certificate signed by the configured CA (the TLS handshake refuses
anyone else) and the client checks the server's certificate against the same CA and the
address it dialled.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc

from ckptd._gen.ckptd.v1 import peer_pb2 as pb
from ckptd._gen.ckptd.v1 import peer_pb2_grpc as pb_grpc
from ckptd.core.groups import GroupMembers
from ckptd.core.ports import PageFrame, PlaceRun
from ckptd.core.receive import Receiver
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CompatReport,
    PeerProbe,
    ReceivedState,
    RemoteRestore,
)
from ckptd.domain.model import ROOT
from ckptd.errors import InvalidTarget, PeerError
from ckptd.transport.grpc.group_rpcs import GroupRpcs
from ckptd.transport.grpc.status import abort_with, error_for

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE = 64 << 20
"""Largest message either side takes; offers are sent in slices of 16 MiB (1 Mi pages)."""
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 30_000),
)
SEND_STREAMS = 2
"""Concurrent Send calls of one transfer."""
SEND_AHEAD = 4
"""Frames queued per call (up to 16 MiB each)."""
CONNECT_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 120.0
FINISH_TIMEOUT_S = 1800.0
"""Finish commits and restores on the target: as long as a big restore may take."""


@dataclass(frozen=True)
class TlsFiles:
    """This node's certificate and key (used as server and as client) and the CA that signs
    every daemon's certificate."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as exc:
            raise PeerError(
                f"cannot read the TLS files ({exc.filename}): {exc.strerror}",
                hint="set tls_cert, tls_key and tls_ca in the daemon's config",
            ) from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


def record_bytes(record: CheckpointRecord) -> bytes:
    return json.dumps(record.to_json()).encode()


def record_from(data: bytes) -> CheckpointRecord:
    try:
        return CheckpointRecord.from_json(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise InvalidTarget(f"the sender's checkpoint record is malformed: {exc}") from exc


def missing_from(data: bytes, address: str) -> list[int]:
    """The page indices an ``OfferResponse`` asks for (u32 each)."""
    if len(data) % 4:
        raise PeerError(f"the daemon at {address} answered an offer with {len(data)} bytes "
                        "of page indices (not a multiple of 4)", address=address)
    return [index for (index,) in struct.iter_unpack("<I", data)]


RUN = struct.Struct("<4I")


def frame_message(session: str, frame: PageFrame) -> pb.PageBatch:
    """A frame on the wire: its data as it is, its runs as four uint32 each."""
    names: dict[str, int] = {}
    runs = b"".join(
        RUN.pack(names.setdefault(name, len(names)), dst, src, count)
        for name, dst, src, count in frame.runs
    )
    return pb.PageBatch(session=session, count=frame.pages, data=frame.data, raw=frame.raw,
                        names=list(names), runs=runs)


def frame_from(batch: pb.PageBatch) -> PageFrame:
    """The frame a message carries; one without runs (consecutive pages of one image) too."""
    if not batch.runs:
        return PageFrame(batch.data, batch.count, ((batch.name, batch.first, 0, batch.count),),
                         raw=batch.raw)
    if len(batch.runs) % RUN.size:
        raise InvalidTarget(f"a frame's runs take {len(batch.runs)} bytes")
    runs: list[PlaceRun] = []
    for name_at, dst, src, count in RUN.iter_unpack(batch.runs):
        if name_at >= len(batch.names):
            raise InvalidTarget(f"a frame's run names image {name_at} of {len(batch.names)}")
        runs.append((batch.names[name_at], dst, src, count))
    return PageFrame(batch.data, batch.count, tuple(runs), raw=batch.raw)


# ---- server -------------------------------------------------------------------------------


class PeerServicer(GroupRpcs, pb_grpc.PeerServicer):
    """Callers hold a certificate of the CA: other daemons, and coordinators of group
    checkpoints (``ckptd.client``); they act as root."""

    def __init__(self, receiver: Receiver, groups: GroupMembers | None = None) -> None:
        self._receiver = receiver
        self._groups = groups
        self._node = receiver.node

    def _unary(self, context: grpc.ServicerContext, fn: Callable[[Caller], T]) -> T:
        return self._call(context, lambda: fn(ROOT))

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:
            abort_with(context, exc, f"peer request from {context.peer()}")

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> Any:
        probe = self._call(context, lambda: self._receiver.probe(record_from(request.record_json)))
        return pb.ProbeResponse(
            node=probe.node, store_id=probe.store_id, blocking=list(probe.report.blocking),
            warnings=list(probe.report.warnings), has_checkpoint=probe.has_checkpoint,
        )

    def Open(self, request: pb.OpenRequest, context: grpc.ServicerContext) -> Any:
        session, seed = self._call(
            context,
            lambda: self._receiver.open(
                record_from(request.record_json), ignore_warnings=request.ignore_warnings
            ),
        )
        log.info("receiving checkpoint from %s (session %s)", context.peer(), session)
        return pb.OpenResponse(session=session, page_seed=seed)

    def Offer(self, request: pb.OfferRequest, context: grpc.ServicerContext) -> Any:
        if not request.pages:
            self._call(
                context,
                lambda: self._receiver.offer_file(
                    request.session, request.name, request.data,
                    request.size if request.compressed else None,
                ),
            )
            return pb.OfferResponse()
        missing = self._call(
            context,
            lambda: self._receiver.offer_pages(
                request.session, request.name, request.size, request.refs, request.first
            ),
        )
        return pb.OfferResponse(missing=struct.pack(f"<{len(missing)}I", *missing))

    def Send(self, request_iterator: Iterator[pb.PageBatch], context: grpc.ServicerContext) -> Any:
        def receive_all() -> int:
            pages = 0
            for batch in request_iterator:
                pages += self._receiver.receive(batch.session, frame_from(batch))
            return pages

        return pb.SendResponse(pages=self._call(context, receive_all))

    def Finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> Any:
        done = self._call(
            context, lambda: self._receiver.finish(request.session, request.output_path)
        )
        log.info("restored migrated checkpoint %s as pid %d", done.checkpoint_id, done.pid)
        return pb.FinishResponse(
            checkpoint_id=done.checkpoint_id, pid=done.pid, output_path=done.output_path,
            node=done.node, restore_s=done.restore_s,
        )

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> Any:
        self._call(context, lambda: self._receiver.abort(request.session))
        return pb.AbortResponse()

    def MigrationOutcome(self, request: pb.MigrationOutcomeRequest,
                         context: grpc.ServicerContext) -> Any:
        state = self._call(context, lambda: self._receiver.received(request.checkpoint_id))
        log.info("asked by %s about migrated checkpoint %s: %s", context.peer(),
                 state.checkpoint_id, "restored" if state.restored else
                 "still restoring" if state.restoring else "not restored (fenced)")
        return pb.MigrationOutcomeResponse(
            node=state.node, restored=state.restored, restoring=state.restoring,
            pid=state.pid, output_path=state.output_path,
        )


def serve_peer(
    server: grpc.Server, receiver: Receiver, listen: str, tls: TlsFiles,
    groups: GroupMembers | None = None,
) -> int:
    """Add the Peer service and a mutual-TLS TCP port to ``server``; returns the port."""
    pb_grpc.add_PeerServicer_to_server(  # type: ignore[no-untyped-call]
        PeerServicer(receiver, groups), server
    )
    port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        raise PeerError(f"cannot listen on {listen}", hint="check peer_listen (host:port)")
    return int(port)


# ---- client -------------------------------------------------------------------------------


class GrpcPeerConnector:
    """``PeerConnector`` over gRPC with mutual TLS (``tls`` None: migration not configured)."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls

    def connect(self, address: str) -> GrpcPeerLink:
        if self._tls is None:
            raise PeerError(
                "this daemon has no TLS certificate for migration",
                hint="set tls_cert, tls_key and tls_ca in its config (see README: migration)",
                address=address,
            )
        channel = grpc.secure_channel(
            address, self._tls.channel_credentials(), options=CHANNEL_OPTIONS
        )
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError as exc:
            channel.close()
            raise PeerError(
                f"cannot reach the ckptd peer listener at {address} within "
                f"{CONNECT_TIMEOUT_S:g}s (no listener, or the TLS handshake failed)",
                hint="check the address, that its daemon has peer_listen set, and that both "
                "certificates are signed by the same CA",
                address=address,
            ) from exc
        return GrpcPeerLink(address, channel)


class GrpcPeerLink:
    def __init__(self, address: str, channel: grpc.Channel) -> None:
        self.address = address
        self._channel = channel
        self._stub = pb_grpc.PeerStub(channel)  # type: ignore[no-untyped-call]

    def probe(self, record: CheckpointRecord) -> PeerProbe:
        r = self._rpc(lambda: self._stub.Probe(
            pb.ProbeRequest(record_json=record_bytes(record)), timeout=CALL_TIMEOUT_S))
        return PeerProbe(
            node=r.node, store_id=r.store_id,
            report=CompatReport(blocking=tuple(r.blocking), warnings=tuple(r.warnings)),
            has_checkpoint=r.has_checkpoint,
        )

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> GrpcPeerSession:
        r = self._rpc(lambda: self._stub.Open(
            pb.OpenRequest(record_json=record_bytes(record), ignore_warnings=ignore_warnings),
            timeout=CALL_TIMEOUT_S))
        return GrpcPeerSession(self, r.session, r.page_seed)

    def received(self, checkpoint_id: str) -> ReceivedState:
        r = self._rpc(lambda: self._stub.MigrationOutcome(
            pb.MigrationOutcomeRequest(checkpoint_id=checkpoint_id), timeout=CALL_TIMEOUT_S))
        return ReceivedState(checkpoint_id, r.node, restored=r.restored,
                             restoring=r.restoring, pid=r.pid, output_path=r.output_path)

    def close(self) -> None:
        self._channel.close()

    def _rpc(self, call: Callable[[], T], *, in_doubt: bool = False) -> T:
        try:
            return call()
        except grpc.RpcError as exc:
            _raise_from_rpc(exc, self.address, in_doubt=in_doubt)


class GrpcPeerSession:
    def __init__(self, link: GrpcPeerLink, session: str, page_seed: int) -> None:
        self._link = link
        self._stub = link._stub
        self.session = session
        self.page_seed = page_seed

    def offer_pages(self, name: str, size: int, refs: bytes, first: int = 0) -> list[int]:
        r = self._link._rpc(lambda: self._stub.Offer(
            pb.OfferRequest(session=self.session, name=name, size=size, refs=refs, pages=True,
                            first=first),
            timeout=CALL_TIMEOUT_S))
        return missing_from(r.missing, self._link.address)

    def offer_file(self, name: str, data: bytes, size: int | None = None) -> None:
        self._link._rpc(lambda: self._stub.Offer(
            pb.OfferRequest(session=self.session, name=name,
                            size=len(data) if size is None else size, data=data,
                            compressed=size is not None),
            timeout=CALL_TIMEOUT_S))

    def send(self, frames: Iterator[PageFrame]) -> int:
        """The frames over SEND_STREAMS concurrent Send calls, dealt in turn: the target
        verifies and writes the frames of one on its own thread while the others arrive. The
        frames are read (and encoded) on this thread: an error reading them is raised as it
        is, after the calls are cancelled; the first failed call ends the sending."""
        queues: list[queue.Queue[pb.PageBatch | None]] = [
            queue.Queue(maxsize=SEND_AHEAD) for _ in range(SEND_STREAMS)
        ]
        calls = [self._stub.Send.future(_drain(q), timeout=FINISH_TIMEOUT_S) for q in queues]
        try:
            for i, frame in enumerate(frames):
                if not _put(queues[i % SEND_STREAMS], frame_message(self.session, frame), calls):
                    break
            else:
                for q in queues:
                    _put(q, None, calls)
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        if _failed(calls):  # the others wait for frames that will never come
            failed = [call for call in calls if call.done() and (
                call.cancelled() or call.exception() is not None)]
            for call in calls:
                if call not in failed:
                    call.cancel()
            for call in failed:
                self._link._rpc(call.result)
        return sum(int(self._link._rpc(call.result).pages) for call in calls)

    def finish(self, output_path: str) -> RemoteRestore:
        r = self._link._rpc(
            lambda: self._stub.Finish(
                pb.FinishRequest(session=self.session, output_path=output_path),
                timeout=FINISH_TIMEOUT_S,
            ),
            in_doubt=True,
        )
        return RemoteRestore(
            checkpoint_id=r.checkpoint_id, pid=r.pid, output_path=r.output_path, node=r.node,
            restore_s=r.restore_s,
        )

    def abort(self) -> None:
        try:
            self._stub.Abort(pb.AbortRequest(session=self.session), timeout=CONNECT_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("abort of session %s on %s failed: %s", self.session,
                        self._link.address, exc.details() if hasattr(exc, "details") else exc)


def _drain(q: queue.Queue[pb.PageBatch | None]) -> Iterator[pb.PageBatch]:
    while (message := q.get()) is not None:
        yield message


def _put(q: queue.Queue[pb.PageBatch | None], item: pb.PageBatch | None,
         calls: list[Any]) -> bool:
    """Queue ``item`` for its call; False (not queued) once any call has failed."""
    while not _failed(calls):
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def _failed(calls: list[Any]) -> bool:
    """Whether a call has ended with an error (a Send call ends well only after its last
    frame, which is queued last)."""
    return any(call.done() and (call.cancelled() or call.exception() is not None)
               for call in calls)


_LINK_BROKEN = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
_IN_DOUBT = {*_LINK_BROKEN, grpc.StatusCode.INTERNAL}
"""After Finish: the target may have restored the tree (an unexpected failure there may come
after the tree runs): never restore it here as well."""


def _raise_from_rpc(exc: grpc.RpcError, address: str, *, in_doubt: bool) -> NoReturn:
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or code.name
    if code in _LINK_BROKEN or (in_doubt and code in _IN_DOUBT):
        raise PeerError(
            f"the daemon at {address} failed: {details}", address=address,
            in_doubt=in_doubt, hint="",
        ) from exc
    raise error_for(code, f"{address}: {details}") from exc
