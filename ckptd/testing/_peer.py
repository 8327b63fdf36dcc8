"""``LoopbackPeerConnector``: a ``PeerConnector`` that reaches ``Receiver`` s in this process.

Addresses map to receivers (``add``); ``connect`` to any other address raises ``PeerError``
as an unreachable daemon does (so does any address while ``unreachable`` counts down, one per
``connect``: a target restarting). ``break_finish`` makes the next ``finish`` lose the link
after the receiver acted (``PeerError`` with ``in_doubt``), to drive a migration's rollback;
``lose_finish`` before it: "dead" (the target died before its restore ran: its session is
dropped, nothing restored), or "detached" (the link breaks while the receiver's ``finish``
goes on, in a thread: ``finishing``); with it, ``restarting`` more ``connect`` calls then fail
(the target restarts).
Passes the same contract suite as the gRPC client (tests/contract/test_peer_contract.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ckptd.core.ports import PageFrame
from ckptd.core.receive import Receiver
from ckptd.domain import CheckpointRecord, PeerProbe, ReceivedState, RemoteRestore
from ckptd.errors import PeerError


class LoopbackPeerSession:
    """``PeerSession``: calls the receiver's session methods directly."""

    def __init__(self, link: LoopbackPeerLink, session: str, page_seed: int) -> None:
        self._link = link
        self._receiver = link.receiver
        self.session = session
        self.page_seed = page_seed

    def offer_pages(self, name: str, size: int, refs: bytes, first: int = 0) -> list[int]:
        return self._receiver.offer_pages(self.session, name, size, refs, first)

    def offer_file(self, name: str, data: bytes, size: int | None = None) -> None:
        self._receiver.offer_file(self.session, name, data, size)

    def send(self, frames: Iterator[PageFrame]) -> int:
        return sum(self._receiver.receive(self.session, frame) for frame in frames)

    def finish(self, output_path: str) -> RemoteRestore:
        connector = self._link.connector
        lose, connector.lose_finish = connector.lose_finish, ""
        if lose == "dead":
            self._receiver.abort(self.session)
        elif lose == "detached":
            connector.finishing = threading.Thread(
                target=self._receiver.finish, args=(self.session, output_path), daemon=True)
            connector.finishing.start()
        if lose:
            connector.unreachable += connector.restarting
            raise PeerError(f"the daemon at {self._link.address} failed: link lost",
                            address=self._link.address, in_doubt=True)
        done = self._receiver.finish(self.session, output_path)
        if self._link.connector.break_finish:
            self._link.connector.break_finish = False
            raise PeerError(
                f"the daemon at {self._link.address} failed: link lost",
                address=self._link.address, in_doubt=True,
            )
        return done

    def abort(self) -> None:
        self._receiver.abort(self.session)


class LoopbackPeerLink:
    """``PeerLink`` to one in-process ``Receiver``; records whether it was closed."""

    def __init__(self, connector: LoopbackPeerConnector, address: str, receiver: Receiver):
        self.connector = connector
        self.address = address
        self.receiver = receiver
        self.closed = False

    def probe(self, record: CheckpointRecord) -> PeerProbe:
        return self.receiver.probe(record)

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> LoopbackPeerSession:
        session, seed = self.receiver.open(record, ignore_warnings=ignore_warnings)
        return LoopbackPeerSession(self, session, seed)

    def received(self, checkpoint_id: str) -> ReceivedState:
        self.connector.asked.append(checkpoint_id)
        return self.receiver.received(checkpoint_id)

    def close(self) -> None:
        self.closed = True


class LoopbackPeerConnector:
    """``PeerConnector`` over ``Receiver`` s added by address (see the module docstring)."""

    def __init__(self) -> None:
        self._receivers: dict[str, Receiver] = {}
        self.break_finish = False
        self.lose_finish = ""
        self.finishing: threading.Thread | None = None
        self.unreachable = 0
        self.restarting = 0
        self.asked: list[str] = []
        """Every ``received`` question, by checkpoint id."""
        self.links: list[LoopbackPeerLink] = []

    def add(self, address: str, receiver: Receiver) -> None:
        self._receivers[address] = receiver

    def connect(self, address: str) -> LoopbackPeerLink:
        receiver = self._receivers.get(address)
        if self.unreachable > 0:
            self.unreachable -= 1
            receiver = None
        if receiver is None:
            raise PeerError(f"cannot reach the ckptd peer listener at {address}",
                            address=address)
        link = LoopbackPeerLink(self, address, receiver)
        self.links.append(link)
        return link
