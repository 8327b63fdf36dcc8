"""The PeerConnector contract: the gRPC client (mutual TLS, a real server on 127.0.0.1) and
``ckptd.testing.LoopbackPeerConnector`` behave the same in front of one ``Receiver``.

The receiver's store is a real ContentStore on a local directory; its restore and compatibility
check are stand-ins that record what they were asked (restoring needs CRIU: the integration
tier does it for real)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import zstandard
from integration.certs import make_ca, make_node_cert

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.ports import PageFrame, PeerLink
from ckptd.core.receive import Receiver
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.pagehash import PAGE_SIZE, PageHasher
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    ProcessFact,
    RestoreOutcome,
    RestoreRequest,
    new_checkpoint_id,
)
from ckptd.errors import (
    CorruptCheckpoint,
    InvalidTarget,
    PeerError,
    PreconditionFailed,
    StoreError,
)
from ckptd.testing import FakeClock, LoopbackPeerConnector
from ckptd.transport.grpc.peer import CHANNEL_OPTIONS, GrpcPeerConnector, TlsFiles, serve_peer


@dataclass
class Target:
    store: ContentStore
    receiver: Receiver
    blocking: list[str] = field(default_factory=list)
    restored: list[RestoreRequest] = field(default_factory=list)


@dataclass
class Peer:
    kind: str
    link: PeerLink
    target: Target


MANIFEST_KEYS = ManifestKeys.generate()
"""One node's manifest keys (a store reopened is read with the same keys)."""


def make_target(tmp: Path, clock: FakeClock) -> Target:
    store = ContentStore(
        LocalBlobStore(tmp / "objects"), StagingPolicy(None, tmp / "staging"), clock=clock,
        is_pages_file=is_pages_image, keys=MANIFEST_KEYS, node="node-b",
    )
    holder: list[Target] = []

    def check(record: CheckpointRecord) -> CompatReport:
        return CompatReport(blocking=tuple(holder[0].blocking))

    def restore(request: RestoreRequest, staged: object = None,
                received: object = None) -> RestoreOutcome:
        holder[0].restored.append(request)
        return RestoreOutcome(request.checkpoint_id, 4321, request.output_path, 0.01)

    receiver = Receiver(
        store=store, pages=store, check=check, restore=restore, clock=clock, node="node-b"
    )
    holder.append(Target(store, receiver))
    return holder[0]


@pytest.fixture(params=["loopback", "grpc"])
def peer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Peer]:
    target = make_target(tmp_path / "b", FakeClock())
    if request.param == "loopback":
        connector = LoopbackPeerConnector()
        connector.add("node-b:7443", target.receiver)
        link = connector.connect("node-b:7443")
        yield Peer("loopback", link, target)
        return
    ca = make_ca(tmp_path / "ca")
    cert, key = make_node_cert(tmp_path / "ca", tmp_path / "certs", "b", ["127.0.0.1"])
    tls = TlsFiles(cert, key, ca)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    port = serve_peer(server, target.receiver, "127.0.0.1:0", tls)
    server.start()
    glink = GrpcPeerConnector(tls).connect(f"127.0.0.1:{port}")
    try:
        yield Peer("grpc", glink, target)
    finally:
        glink.close()
        server.stop(0)


def a_record(uid: int = 1000) -> CheckpointRecord:
    return CheckpointRecord(
        id=new_checkpoint_id(1_800_000_000.0 + random.random()), pid=4321,
        created=1_800_000_000.0, node="node-a", uid=uid,
        processes=(ProcessFact(4321, 1, "job", ("job",), uid, uid, rss=1 << 20),),
    )


def pages_image(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    pages = [bytes(PAGE_SIZE) if i % 5 == 0 else rng.randbytes(PAGE_SIZE) for i in range(n)]
    return b"".join(pages)


def refs_of(data: bytes, seed: int) -> list[bytes]:
    hasher = PageHasher.from_seed(seed)
    return [hasher.page_ref(data[o : o + PAGE_SIZE]) for o in range(0, len(data), PAGE_SIZE)]


def send_missing(session: object, name: str, data: bytes, missing: list[int]) -> int:
    frames = (
        PageFrame(zstandard.ZstdCompressor().compress(data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]),
                  1, ((name, i, 0, 1),))
        for i in missing
    )
    return int(session.send(frames))  # type: ignore[attr-defined]


def transfer(peer: Peer, record: CheckpointRecord, files: dict[str, bytes]) -> list[int]:
    """Offer and send ``files`` as a migration does; returns the missing page indices."""
    session = peer.link.open(record, False)
    missing: list[int] = []
    for name, data in files.items():
        if is_pages_image(name):
            refs = refs_of(data, session.page_seed)
            missing = session.offer_pages(name, len(data), b"".join(refs))
            assert send_missing(session, name, data, missing) == len(missing)
        else:
            session.offer_file(name, data)
    done = session.finish("/tmp/out")
    assert (done.checkpoint_id, done.pid, done.node) == (record.id, 4321, "node-b")
    assert peer.target.receiver.wait_commits(30), "the background commit finishes"
    return missing


def test_probe_says_who_it_is_and_what_it_thinks(peer: Peer) -> None:
    peer.target.blocking = ["CPU lacks avx512f used at dump"]
    probe = peer.link.probe(a_record())
    assert probe.node == "node-b"
    assert probe.store_id == peer.target.store.store_id
    assert probe.report.blocking == ("CPU lacks avx512f used at dump",)
    assert not probe.has_checkpoint


def test_a_checkpoint_arrives_whole_and_is_restored(peer: Peer) -> None:
    record = a_record()
    files = {"pages-1.img": pages_image(40, 1), "core-1.img": b"core" * 50}
    missing = transfer(peer, record, files)
    assert len(missing) == 32, "every non-zero page was missing"
    assert [r.checkpoint_id for r in peer.target.restored] == [record.id]
    assert peer.target.restored[0].output_path == "/tmp/out"
    assert [r.id for r in peer.target.store.list()] == [record.id]
    with peer.target.store.checkout(record.id) as images:
        assert {p.name: p.read_bytes() for p in images.iterdir()} == files


def test_a_second_transfer_is_asked_only_for_changed_pages(peer: Peer) -> None:
    first = pages_image(40, 1)
    transfer(peer, a_record(), {"pages-1.img": first, "core-1.img": b"c1"})
    second = bytearray(first)
    second[3 * PAGE_SIZE : 3 * PAGE_SIZE + 8] = b"changed!"
    second[7 * PAGE_SIZE : 7 * PAGE_SIZE + 8] = b"changed!"
    record = a_record()
    missing = transfer(peer, record, {"pages-1.img": bytes(second), "core-1.img": b"c2"})
    assert missing == [3, 7]
    with peer.target.store.checkout(record.id) as images:
        assert (images / "pages-1.img").read_bytes() == bytes(second)


def test_a_page_that_does_not_match_its_hash_is_refused_and_nothing_listed(peer: Peer) -> None:
    record = a_record()
    data = pages_image(8, 2)
    session = peer.link.open(record, False)
    missing = session.offer_pages("pages-1.img", len(data), b"".join(
        refs_of(data, session.page_seed)))
    forged = bytearray(data)
    forged[missing[0] * PAGE_SIZE] ^= 0xFF
    with pytest.raises(CorruptCheckpoint, match="does not match its hash"):
        send_missing(session, "pages-1.img", bytes(forged), missing[:1])
    session.abort()
    assert peer.target.store.list() == []
    assert peer.target.restored == []


def test_an_incompatible_target_refuses_to_open(peer: Peer) -> None:
    peer.target.blocking = ["file /data/tokenizer.json missing"]
    with pytest.raises(PreconditionFailed, match=r"tokenizer\.json missing"):
        peer.link.open(a_record(), False)


def test_an_aborted_or_unknown_session_leaves_nothing(peer: Peer) -> None:
    record = a_record()
    session = peer.link.open(record, False)
    session.offer_file("core-1.img", b"core")
    session.abort()
    assert peer.target.store.list() == []
    with pytest.raises(InvalidTarget, match="no transfer session"):
        session.offer_file("core-1.img", b"core")
    with pytest.raises(InvalidTarget):
        session.offer_pages("../evil", PAGE_SIZE, bytes(16))


def test_a_finish_without_every_asked_page_fails_and_lists_nothing(peer: Peer) -> None:
    record = a_record()
    data = pages_image(8, 3)
    session = peer.link.open(record, False)
    missing = session.offer_pages("pages-1.img", len(data), b"".join(
        refs_of(data, session.page_seed)))
    send_missing(session, "pages-1.img", data, missing[:-1])
    with pytest.raises((PeerError, StoreError), match="never arrived"):
        session.finish("")
    assert peer.target.store.list() == []
    assert peer.target.restored == []


def test_an_image_offered_in_slices_arrives_whole(peer: Peer) -> None:
    record = a_record()
    data = pages_image(30, 4)
    session = peer.link.open(record, False)
    refs = refs_of(data, session.page_seed)
    missing: list[int] = []
    for first in (0, 10, 20):
        missing += session.offer_pages("pages-1.img", len(data),
                                       b"".join(refs[first : first + 10]), first)
    assert missing == [i for i in range(30) if i % 5]
    send_missing(session, "pages-1.img", data, missing)
    session.offer_file("core-1.img", b"core")
    session.finish("")
    assert peer.target.receiver.wait_commits(30)
    with peer.target.store.checkout(record.id) as images:
        assert (images / "pages-1.img").read_bytes() == data


def test_slices_out_of_order_or_missing_are_refused(peer: Peer) -> None:
    data = pages_image(20, 5)
    session = peer.link.open(a_record(), False)
    refs = refs_of(data, session.page_seed)
    session.offer_pages("pages-1.img", len(data), b"".join(refs[:10]), 0)
    with pytest.raises(InvalidTarget, match="out of order"):
        session.offer_pages("pages-1.img", len(data), b"".join(refs[15:]), 15)
    with pytest.raises((PeerError, StoreError), match="only 10 of 20 pages were offered"):
        session.finish("")
    assert peer.target.store.list() == []


@pytest.mark.parametrize("bad_id", ["/etc", "../../etc/cron.d", "ck-x/../../y", ""])
def test_a_record_whose_id_is_not_a_checkpoint_id_is_refused(peer: Peer, bad_id: str) -> None:
    """The id names staging directories here: a path from the sender must never be used."""
    record = CheckpointRecord(**{**a_record().__dict__, "id": bad_id})
    with pytest.raises(InvalidTarget, match="bad checkpoint id"):
        peer.link.open(record, False)
    assert peer.target.store.list() == []


def test_one_frame_fills_places_in_two_images_raw_or_zstd(peer: Peer) -> None:
    """A frame's runs place its pages in several images (a page in two places too); a raw
    frame is taken as it is; runs outside what was offered are refused."""
    record = a_record()
    one, two = pages_image(10, 8), pages_image(6, 9)
    session = peer.link.open(record, False)
    missing = {name: session.offer_pages(name, len(data), b"".join(
        refs_of(data, session.page_seed))) for name, data in
        (("pages-1.img", one), ("pages-2.img", two))}
    with pytest.raises(InvalidTarget, match="out of range"):
        session.send(iter([PageFrame(one[:PAGE_SIZE], 1, (("pages-1.img", 10, 0, 1),),
                                     raw=True)]))
    session.abort()
    # pages 1..4 of one, raw; page 1 of two has the content of page 1 of one: placed twice
    two = two[:PAGE_SIZE] + one[PAGE_SIZE:2 * PAGE_SIZE] + two[2 * PAGE_SIZE:]
    record = a_record()
    session = peer.link.open(record, False)
    missing = {name: session.offer_pages(name, len(data), b"".join(
        refs_of(data, session.page_seed))) for name, data in
        (("pages-1.img", one), ("pages-2.img", two))}
    raw = PageFrame(one[PAGE_SIZE:5 * PAGE_SIZE], 4,
                    (("pages-1.img", 1, 0, 4), ("pages-2.img", 1, 0, 1)), raw=True)
    rest = [(n, i) for n, idx in missing.items() for i in idx
            if not (n == "pages-1.img" and 1 <= i <= 4) and not (n == "pages-2.img" and i == 1)]
    data = {"pages-1.img": one, "pages-2.img": two}
    packed = zstandard.ZstdCompressor().compress(b"".join(
        data[n][i * PAGE_SIZE:(i + 1) * PAGE_SIZE] for n, i in rest))
    zframe = PageFrame(packed, len(rest), tuple((n, i, k, 1) for k, (n, i) in enumerate(rest)))
    assert session.send(iter([raw, zframe])) == 5 + len(rest)
    session.offer_file("core-1.img", zstandard.ZstdCompressor().compress(b"core" * 9), 36)
    session.finish("")
    assert peer.target.receiver.wait_commits(30)
    with peer.target.store.checkout(record.id) as images:
        assert {p.name: p.read_bytes() for p in images.iterdir()} == {
            "pages-1.img": one, "pages-2.img": two, "core-1.img": b"core" * 9}


def test_a_damaged_frame_among_many_ends_the_sending(peer: Peer) -> None:
    """Frames after the damaged one are not waited for (the gRPC client sends on several
    streams: the failed one cancels the others) and nothing is listed."""
    record = a_record()
    data = pages_image(40, 10)
    session = peer.link.open(record, False)
    missing = session.offer_pages("pages-1.img", len(data), b"".join(
        refs_of(data, session.page_seed)))
    frames = [PageFrame(data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE], 1, (("pages-1.img", i, 0, 1),),
                        raw=True) for i in missing]
    frames[5] = PageFrame(bytes(PAGE_SIZE - 1) + b"x", 1, frames[5].runs, raw=True)
    with pytest.raises(CorruptCheckpoint, match="does not match its hash"):
        session.send(iter(frames))
    session.abort()
    assert peer.target.store.list() == [] and peer.target.restored == []


def test_asked_after_a_restore_it_says_restored_with_the_pid(peer: Peer) -> None:
    record = a_record()
    transfer(peer, record, {"pages-1.img": pages_image(8, 4), "core-1.img": b"core"})
    state = peer.link.received(record.id)
    assert (state.checkpoint_id, state.node, state.restored, state.restoring) == (
        record.id, "node-b", True, False)
    assert (state.pid, state.output_path) == (4321, "/tmp/out")


def test_asked_about_one_it_never_restored_it_says_so_and_never_restores_it(peer: Peer) -> None:
    """The answer is a fence: a finish of that checkpoint afterwards is refused, and nothing
    is restored or listed."""
    record = a_record()
    session = peer.link.open(record, False)
    session.offer_file("core-1.img", b"core")
    state = peer.link.received(record.id)
    assert (state.node, state.restored, state.restoring, state.pid) == ("node-b", False, False, 0)
    with pytest.raises(PreconditionFailed, match="settled as not restored on node-b"):
        session.finish("/tmp/out")
    assert peer.target.restored == [] and peer.target.store.list() == []
    assert not peer.link.received(record.id).restored
    with pytest.raises(InvalidTarget, match="bad checkpoint id"):
        peer.link.received("../evil")
