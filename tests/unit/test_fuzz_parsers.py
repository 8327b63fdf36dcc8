"""Fuzz every parser of untrusted bytes (issue #14, point 6): manifests, packs, page lists,
the CRIU images ckptd reads, CRIU's page-server and image-streamer protocols, and what a peer
daemon sends. Each is fed arbitrary bytes and, above all, *mutated valid encodings* (made by
the real encoder, then bytes flipped, set, inserted, deleted, truncated): the parser either
returns a value that round-trips or validates, or raises ckptd's own error for it; never a
foreign exception (IndexError, struct.error, UnicodeDecodeError, KeyError, RecursionError,
MemoryError from a declared length, a protobuf DecodeError) and never a hang.

Bugs these found are pinned as ``@example``s.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptd._gen.ckptd.v1 import peer_pb2 as pb
from ckptd._gen.criu import img_streamer_pb2, pstree_pb2, stats_pb2
from ckptd.adapters.criu import images, imgstreamer, pageserver
from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.ports import PageFrame
from ckptd.core.receive import Receiver
from ckptd.core.store import manifest as manifest_module
from ckptd.core.store import pagelist
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.index import check_pack, load_pack_index, pack_key
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import FileEntry, Manifest
from ckptd.core.store.packs import (
    FOOTER,
    PackBuilder,
    PackIndex,
    decode_trailer,
    encode_trailer,
    parse_footer,
    read_frame_data,
)
from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_REF, PageHasher
from ckptd.domain import CheckpointRecord, CompatReport, ProcessFact, new_checkpoint_id
from ckptd.errors import CkptdError, CorruptCheckpoint, InvalidTarget, PeerError
from ckptd.testing import FakeClock, MemoryBlobStore
from ckptd.transport.grpc.peer import (
    frame_from,
    frame_message,
    missing_from,
    record_bytes,
    record_from,
)

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IO = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- mutating a valid encoding ---------------------------------------------------------------


@st.composite
def mutate(draw: st.DrawFn, valid: bytes, max_ops: int = 4) -> bytes:
    """``valid`` with 1..max_ops byte-level edits: flips, set bytes (0, 0xff, anything),
    inserts, deletes, a truncation or an extension."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, draw(st.integers(0, 255))]))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def fuzzed(valid: bytes, max_ops: int = 4) -> st.SearchStrategy[bytes]:
    """Mostly mutations of ``valid``; some arbitrary bytes."""
    return st.one_of(mutate(valid, max_ops), mutate(valid, max_ops), st.binary(max_size=256))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)


# ---- manifests -------------------------------------------------------------------------------

KEYS = ManifestKeys.generate()
OTHER_KEYS = ManifestKeys.generate()
STORE_ID = "store-1"
CID = new_checkpoint_id(1_700_000_000.0)
RECORD = CheckpointRecord(
    id=CID, pid=4321, created=1_700_000_000.0, node="node-a", uid=1000,
    processes=(ProcessFact(4321, 1, "job", ("job", "--x"), 1000, 1000),),
)
MANIFEST = Manifest(
    record=RECORD, uid=1000,
    files=(FileEntry("core-1.img", 400, blob="ab" * 16),
           FileEntry("pages-1.img", 8192, pagelist="cd" * 16, pages=2)),
    packs=("ef" * 16,), blobs=("ab" * 16, "cd" * 16),
)
SIGNED = MANIFEST.to_bytes(KEYS, STORE_ID)


def legacy_bytes(raw: dict[str, Any]) -> bytes:
    body = json.dumps(raw, sort_keys=True).encode()
    return body + b"\n" + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"


LEGACY = legacy_bytes({"format": 1, **MANIFEST._fields()})


@FAST
@given(fuzzed(SIGNED))
def test_a_mutated_manifest_is_the_manifest_or_refused(data: bytes) -> None:
    try:
        got = Manifest.from_bytes(data, CID, KEYS, STORE_ID)
    except CorruptCheckpoint as exc:
        assert exc.checkpoint_id == CID
    else:
        assert got == MANIFEST  # authenticated: only a harmless edit (a trailing newline)
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_bytes(data, CID, OTHER_KEYS, STORE_ID)
    manifest_module.names_unverified(data)
    manifest_module.is_legacy(data)


@FAST
@given(fuzzed(LEGACY))
def test_a_mutated_legacy_manifest_is_refused_by_from_bytes_and_checked_by_adoption(
    data: bytes,
) -> None:
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_bytes(data, CID, KEYS, STORE_ID)
    try:
        got = Manifest.from_legacy_bytes(data, CID)
    except CorruptCheckpoint:
        pass
    else:
        assert got == MANIFEST
    manifest_module.names_unverified(data)


def _fields_strategy() -> st.SearchStrategy[dict[str, Any]]:
    """The manifest's JSON with some fields replaced by arbitrary JSON (what a writer with
    the key, or an adopted format-1 manifest, could hold)."""
    base = {"format": 2, "id": CID, "store": STORE_ID, **MANIFEST._fields()}
    record = dict(base["record"])
    paths = ["uid", "files", "packs", "blobs", "format", "id", "store", "record",
             "record.id", "record.uid", "record.processes", "record.labels", "record.stdio",
             "record.gpu", "record.fingerprint", "record.files", "files.0", "files.0.size"]

    @st.composite
    def edited(draw: st.DrawFn) -> dict[str, Any]:
        raw = json.loads(json.dumps({**base, "record": record}))
        for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
            *parents, leaf = path.split(".")
            node: Any = raw
            for p in parents:
                if isinstance(node, list):
                    node = node[int(p)] if len(node) > int(p) else None
                else:
                    node = node.get(p)
                if not isinstance(node, dict | list):
                    break
            else:
                value = draw(json_values)
                if isinstance(node, list):
                    if node:
                        node[0] = value
                else:
                    node[leaf] = value
        return raw

    return edited()


@FAST
@given(_fields_strategy())
@example({"format": 2, "id": CID, "store": STORE_ID, "record": [[[[[]]]]] * 3000})
@example({**json.loads(SIGNED.split(b"\n")[0]),  # the refusal sliced a record id of None
          "record": {**RECORD.to_json(), "id": None}})
def test_an_authentic_manifest_with_any_json_is_read_or_refused(raw: dict[str, Any]) -> None:
    """Past the MAC, ``_checked`` takes any JSON a key holder wrote."""
    body = json.dumps(raw).encode()
    kid, mac = KEYS.sign(body)
    data = body + f"\n{kid} {mac}\n".encode()
    try:
        got = Manifest.from_bytes(data, CID, KEYS, STORE_ID)
    except CorruptCheckpoint:
        return
    assert got.record.id == CID and got.uid == got.record.uid


def test_deeply_nested_json_is_refused_not_a_recursion_error() -> None:
    """Found by the fuzzer: ``json.loads`` raises RecursionError on deep nesting, which the
    legacy reader and GC's unverified names let through."""
    bomb = b"[" * 200_000
    data = bomb + b"\n" + xxhash.xxh3_128_hexdigest(bomb).encode() + b"\n"
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_legacy_bytes(data, CID)
    assert manifest_module.names_unverified(data + b"x x\n") == ([], [])


# ---- page lists ------------------------------------------------------------------------------

REFS = [bytes([i]) * HASH_SIZE for i in range(1, 6)] + [ZERO_REF] * 3 + [b"\x07" * HASH_SIZE]
BASE = [b"\x09" * HASH_SIZE, *REFS[:4], ZERO_REF, REFS[5 % len(REFS)]]
BASE_HASH = b"\x42" * HASH_SIZE
FULL = pagelist.encode_full(REFS)
DELTA = pagelist.encode_delta(REFS, BASE, BASE_HASH)


def _check_decoded(data: bytes, base: list[bytes] | None, pages: int | None) -> None:
    try:
        refs = pagelist.decode(data, base, pages=pages)
    except CorruptCheckpoint:
        return
    assert all(isinstance(r, bytes) and len(r) == HASH_SIZE for r in refs)
    assert pages is None or len(refs) == pages
    assert pagelist.decode(pagelist.encode_full(refs)) == refs  # round-trips


@FAST
@given(fuzzed(FULL), st.booleans())
@example(pagelist.MAGIC + struct.pack("<BI", 0, 0xFFFFFFFF) + struct.pack("<BI", 1, 0xFFFFFFFF),
         True)
@example(pagelist.MAGIC, False)  # base_of raised struct.error
@example(pagelist.MAGIC + struct.pack("<BI", 1, 2) + b"\x42", False)  # a base hash cut short
def test_a_mutated_full_page_list_decodes_or_is_refused(data: bytes, bounded: bool) -> None:
    _check_decoded(data, None, len(REFS) if bounded else None if _small(data) else len(REFS))
    _check_decoded(data, BASE, len(REFS))
    with contextlib.suppress(CorruptCheckpoint):
        pagelist.base_of(data)


@FAST
@given(fuzzed(DELTA), st.booleans())
def test_a_mutated_delta_page_list_decodes_or_is_refused(data: bytes, with_base: bool) -> None:
    _check_decoded(data, BASE if with_base else None, len(REFS))
    if _small(data):
        _check_decoded(data, BASE, None)


def _small(data: bytes) -> bool:
    """A header count that is safe to decode without a bound (a million references)."""
    if len(data) < len(pagelist.MAGIC) + 5:
        return True
    return struct.unpack_from("<I", data, len(pagelist.MAGIC) + 1)[0] <= 1 << 20


def test_a_page_list_whose_header_disagrees_with_its_entry_allocates_nothing() -> None:
    """Found by the fuzzer: a 14-byte list declaring 2**32-1 zero pages built a list of
    4 Gi references (32 GiB) before anything else was checked. The reader now passes the
    manifest entry's page count, checked against the header first."""
    bomb = pagelist.MAGIC + struct.pack("<BI", 0, 0xFFFFFFFF) + struct.pack("<BI", 1, 0xFFFFFFFF)
    with pytest.raises(CorruptCheckpoint, match="header says"):
        pagelist.decode(bomb, pages=2)


# ---- packs -----------------------------------------------------------------------------------

HASHER = PageHasher(b"secret", 1000)


def _pages() -> list[bytes]:
    import random

    rng = random.Random(14)
    return [rng.randbytes(PAGE_SIZE) if i in (0, 1, 4) else bytes([i]) * PAGE_SIZE
            for i in range(6)]


PAGES = _pages()


def _build_pack() -> tuple[str, bytes, PackIndex]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        builder = PackBuilder(pool)
        for i, page in enumerate(PAGES):
            builder.add(HASHER.digest(page), memoryview(page))
            if i in (1, 3):  # three frames: raw (random), zstd (repeated), mixed
                builder.cut_frame()
        builder.finish()
        from ckptd.core.store.packs import build_pack

        (group,) = builder.take_sealed()
        return build_pack(group)


PACK_ID, PACK, PACK_INDEX = _build_pack()
TRAILER_AT, TRAILER_LEN, _ = parse_footer(PACK_ID, PACK[-FOOTER.size :])
TRAILER = PACK[TRAILER_AT : TRAILER_AT + TRAILER_LEN]
TRAILER_RAW = zstandard.ZstdDecompressor().decompress(TRAILER)


def test_the_pack_under_fuzz_has_raw_and_zstd_frames() -> None:
    sizes = [f.length for f in PACK_INDEX.frames]
    assert len(sizes) == 3 and sizes[0] == 2 * PAGE_SIZE and sizes[1] < 2 * PAGE_SIZE


@FAST
@given(fuzzed(PACK, max_ops=3))
def test_a_mutated_pack_is_checked_or_refused_and_its_pages_verified(data: bytes) -> None:
    blobs = MemoryBlobStore()
    blobs.put(pack_key(PACK_ID), data)
    try:
        index = check_pack(blobs, PACK_ID)
    except CorruptCheckpoint:
        return
    assert load_pack_index(blobs, PACK_ID) == index
    for no, frame in enumerate(index.frames):
        raw = data[frame.offset : frame.offset + frame.length]
        try:
            got = read_frame_data(PACK_ID, no, raw, frame.hashes, HASHER)
        except CorruptCheckpoint:
            continue
        for i, h in enumerate(frame.hashes):
            assert HASHER.digest(got[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]) == h


@FAST
@given(st.one_of(fuzzed(TRAILER), fuzzed(TRAILER_RAW).map(
    lambda raw: zstandard.ZstdCompressor().compress(raw))))
@example(zstandard.ZstdCompressor().compress(struct.pack("<I", 1)
                                              + struct.pack("<QII", 8, 100, 0xFFFFFFFF)))
def test_a_mutated_trailer_decodes_or_is_refused(raw_trailer: bytes) -> None:
    """Found by the fuzzer: a frame declaring 2**32-1 pages built a tuple of 4 Gi (empty)
    hashes; hashes cut short were taken as they were."""
    try:
        index = decode_trailer(PACK_ID, raw_trailer)
    except CorruptCheckpoint:
        return
    assert all(len(h) == HASH_SIZE for f in index.frames for h in f.hashes)
    assert decode_trailer(PACK_ID, encode_trailer(index.frames)) == index


@FAST
@given(fuzzed(PACK[-FOOTER.size :]))
def test_a_mutated_footer_parses_or_is_refused(footer: bytes) -> None:
    try:
        offset, length, checksum = parse_footer(PACK_ID, footer)
    except CorruptCheckpoint:
        return
    assert offset >= 0 and length >= 0 and len(checksum) == 8


def _zstd_frame(pages: list[bytes], *, content_size: bool) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(b"".join(pages))


FRAMES = [
    (b"".join(PAGES[:2]), tuple(HASHER.digest(p) for p in PAGES[:2])),
    (_zstd_frame(PAGES[2:4], content_size=True), tuple(HASHER.digest(p) for p in PAGES[2:4])),
    (_zstd_frame(PAGES[2:4], content_size=False), tuple(HASHER.digest(p) for p in PAGES[2:4])),
]


@FAST
@given(st.sampled_from(range(len(FRAMES))).flatmap(
    lambda i: st.tuples(st.just(i), fuzzed(FRAMES[i][0], max_ops=3))),
    st.integers(-2, 2))
def test_a_mutated_frame_reads_verified_or_is_refused(case: tuple[int, bytes], extra: int
                                                      ) -> None:
    """Raw and zstd frames (with and without their size), with wrong declared sizes: pages
    come back verified, or CorruptCheckpoint."""
    i, raw = case
    hashes = FRAMES[i][1]
    hashes = hashes[: max(1, len(hashes) + extra)] if extra < 0 else (
        hashes + (b"\x01" * HASH_SIZE,) * extra)
    try:
        got = read_frame_data(PACK_ID, 0, raw, hashes, HASHER)
    except CorruptCheckpoint:
        return
    assert len(got) == len(hashes) * PAGE_SIZE
    for k, h in enumerate(hashes):
        assert HASHER.digest(got[k * PAGE_SIZE : (k + 1) * PAGE_SIZE]) == h


# ---- CRIU images ckptd reads -----------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-") as name:
        yield Path(name)


def _stats_image() -> bytes:
    entry = stats_pb2.stats_entry(dump=stats_pb2.dump_stats_entry(
        freezing_time=1, frozen_time=2, memdump_time=3, memwrite_time=4, pages_scanned=5,
        pages_skipped_parent=6, pages_written=7, pages_lazy=0))
    body = entry.SerializeToString()
    return struct.pack("<III", images.IMG_SERVICE_MAGIC, images.STATS_MAGIC, len(body)) + body


def _pstree_image() -> bytes:
    out = struct.pack("<II", images.IMG_COMMON_MAGIC, images.PSTREE_MAGIC)
    for pid, ppid in ((100, 1), (101, 100), (102, 100)):
        body = pstree_pb2.pstree_entry(pid=pid, ppid=ppid, pgid=100, sid=100,
                                       threads=[pid]).SerializeToString()
        out += struct.pack("<I", len(body)) + body
    return out


STATS = _stats_image()
PSTREE = _pstree_image()


@IO
@given(fuzzed(STATS))
@example(STATS[:12] + b"\xff" * (len(STATS) - 12))
def test_a_mutated_stats_image_reads_or_is_none(scratch: Path, data: bytes) -> None:
    """Found by the fuzzer: a body that does not parse raised protobuf's DecodeError."""
    (scratch / "stats-dump").write_bytes(data)
    got = images.read_dump_stats(scratch)
    assert got is None or isinstance(got, stats_pb2.dump_stats_entry)


@IO
@given(fuzzed(PSTREE))
@example(PSTREE[:8] + struct.pack("<I", 2) + b"\xff\xff")
def test_a_mutated_pstree_image_reads_or_is_empty(scratch: Path, data: bytes) -> None:
    (scratch / "pstree.img").write_bytes(data)
    got = images.read_pstree(scratch)
    assert all(isinstance(pid, int) and pid >= 0 for pid in got)


def test_the_valid_images_read() -> None:
    with tempfile.TemporaryDirectory() as name:
        (Path(name) / "pstree.img").write_bytes(PSTREE)
        (Path(name) / "stats-dump").write_bytes(STATS)
        assert images.read_pstree(Path(name)) == (100, 101, 102)
        stats = images.read_dump_stats(Path(name))
        assert stats is not None and stats.pages_written == 7


# ---- CRIU's page-server protocol -------------------------------------------------------------


def _ps_stream(wire: pageserver.Wire) -> bytes:
    dst = 42 << 8 | pageserver.PS_TYPE_PID
    iov = wire.iov
    return b"".join([
        iov.pack(pageserver.PS_IOV_OPEN2, 0, 0, dst),
        iov.pack(pageserver.PS_IOV_PARENT, 0, 0, dst),
        iov.pack(pageserver.PS_IOV_ADD_F | pageserver.PE_PRESENT << 16, 2, 0x1000, dst),
        PAGES[0], PAGES[1],
        iov.pack(pageserver.PS_IOV_HOLE, 1, 0x3000, dst),
        iov.pack(pageserver.PS_IOV_ADD, 1, 0x4000, dst), PAGES[2],
        iov.pack(pageserver.PS_IOV_CLOSE, 0, 0, 0),
    ])


PS_STREAMS = {"4.2": (pageserver.WIRE_42, _ps_stream(pageserver.WIRE_42)),
              "4.1": (pageserver.WIRE_41, _ps_stream(pageserver.WIRE_41))}


def _serve_pages(directory: Path, wire: pageserver.Wire, stream: bytes) -> None:
    """Run a receiver on ``stream`` (then EOF), CRIU's side reading every answer."""
    server = pageserver.PageServer(directory, pageserver.FileSink(directory),
                                   chunk=2 * PAGE_SIZE, buffers=2, wire=wire)
    criu = server.criu_end()
    criu.settimeout(10)
    server.start()

    def answers() -> None:
        try:
            while criu.recv(4096):
                pass
        except OSError:
            pass

    reader = threading.Thread(target=answers, daemon=True)
    reader.start()
    try:
        criu.sendall(stream)
        criu.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the receiver gave up part-way and shut the socket
    try:
        server.wait(timeout=10)
    except pageserver.PageServerError as exc:
        assert "did not finish in time" not in str(exc), "the receiver hung"
        cause = exc.__cause__
        assert cause is None or isinstance(cause, pageserver.PageServerError | OSError), (
            f"the receiver failed with a foreign {type(cause).__name__}: {cause}")
    finally:
        reader.join(10)
        criu.close()
    assert not reader.is_alive()


@IO
@given(st.sampled_from(sorted(PS_STREAMS)).flatmap(
    lambda v: st.tuples(st.just(v), fuzzed(PS_STREAMS[v][1], max_ops=3))))
def test_a_mutated_page_server_stream_ends_with_page_server_error(case: tuple[str, bytes]
                                                                   ) -> None:
    version, stream = case
    with tempfile.TemporaryDirectory() as name:
        _serve_pages(Path(name), PS_STREAMS[version][0], stream)


def test_the_valid_page_server_stream_is_received() -> None:
    for wire, stream in PS_STREAMS.values():
        with tempfile.TemporaryDirectory() as name:
            _serve_pages(Path(name), wire, stream)
            assert (Path(name) / "pages-1.img").read_bytes() == b"".join(PAGES[:3])
            assert (Path(name) / "pagemap-42.img").exists()


# ---- CRIU's image-streamer requests ----------------------------------------------------------

REQUESTS = b"".join(imgstreamer.encode_message(
    img_streamer_pb2.img_streamer_request_entry(filename=n)) for n in ("pstree.img", "pages-1.img"))


@IO
@given(fuzzed(REQUESTS))
@example(struct.pack("=I", 4) + b"\x0a\x02\xff\xfe")
def test_mutated_image_streamer_requests_give_names_or_a_protocol_error(data: bytes) -> None:
    """Found by the fuzzer: a file name that is not UTF-8 came back as bytes (proto2)."""
    ours, criu = socket.socketpair()
    with ours, criu:
        ours.settimeout(10)
        criu.sendall(data)
        criu.shutdown(socket.SHUT_WR)
        names = []
        try:
            while (name := imgstreamer.read_request(ours)) is not None:
                names.append(name)
        except imgstreamer.StreamProtocolError:
            pass
        assert all(isinstance(n, str) and n for n in names)
        if data == REQUESTS:
            assert names == ["pstree.img", "pages-1.img"]


# ---- what a peer daemon sends ----------------------------------------------------------------

RECORD_JSON = record_bytes(RECORD)


@FAST
@given(st.one_of(fuzzed(RECORD_JSON), _fields_strategy().map(
    lambda raw: json.dumps(raw["record"]).encode())))
@example(b"[" * 100_000)
def test_a_mutated_peer_record_converts_or_is_refused(data: bytes) -> None:
    """Found by the fuzzer: deep nesting raised RecursionError."""
    try:
        record = record_from(data)
    except InvalidTarget:
        return
    assert isinstance(record, CheckpointRecord)


@FAST
@given(st.binary(max_size=64))
def test_an_offer_answer_gives_page_indices_or_a_peer_error(data: bytes) -> None:
    """Found by the fuzzer: an answer not a multiple of 4 bytes raised struct.error."""
    try:
        got = missing_from(data, "b:7443")
    except PeerError:
        assert len(data) % 4
        return
    assert len(got) == len(data) // 4 and all(0 <= i < 2**32 for i in got)


class _Target:
    """A Receiver over a real content store, with one open session and its pages image
    offered (4 pages: two of PAGES, a zero page, one more)."""

    def __init__(self, root: Path) -> None:
        clock = FakeClock()
        self.store = ContentStore(
            LocalBlobStore(root / "objects"), StagingPolicy(None, root / "staging"),
            clock=clock, is_pages_file=is_pages_image, keys=KEYS,
        )
        self.receiver = Receiver(
            store=self.store, pages=self.store, check=lambda _r: CompatReport(),
            restore=lambda *_a: pytest.fail("no restore here"), clock=clock, node="node-b",
        )
        self.record = CheckpointRecord(**{**RECORD.__dict__, "id": new_checkpoint_id(2e9)})
        self.session, seed = self.receiver.open(self.record, ignore_warnings=False)
        self.hasher = PageHasher.from_seed(seed)
        self.pages = [PAGES[0], PAGES[1], bytes(PAGE_SIZE), PAGES[3]]
        self.refs = b"".join(self.hasher.page_ref(p) for p in self.pages)
        self.offer()

    def offer(self) -> None:
        self.receiver.offer_pages(self.session, "pages-1.img", 4 * PAGE_SIZE, self.refs, 0)

    def batch(self, raw: bool) -> bytes:
        wanted = [self.pages[i] for i in (0, 1, 3)]
        data = b"".join(wanted) if raw else _zstd_frame(wanted, content_size=True)
        frame = PageFrame(data, 3, (("pages-1.img", 0, 0, 2), ("pages-1.img", 3, 2, 1)),
                          raw=raw)
        return frame_message(self.session, frame).SerializeToString()


@pytest.fixture(scope="module")
def target() -> Iterator[_Target]:
    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-peer-") as name:
        yield _Target(Path(name))


def test_valid_page_batches_are_received(target: _Target) -> None:
    for raw in (True, False):
        batch = pb.PageBatch.FromString(target.batch(raw))
        assert target.receiver.receive(target.session, frame_from(batch)) == 3


@IO
@given(st.booleans(), st.data())
def test_a_mutated_page_batch_is_received_or_refused(
    target: _Target, raw: bool, data: st.DataObject,
) -> None:
    """A PageBatch as it comes off the wire (grpc deserializes it: protobuf's DecodeError
    never reaches ckptd), converted and received: pages written only verified."""
    from google.protobuf.message import DecodeError

    wire = data.draw(fuzzed(target.batch(raw), max_ops=3))
    try:
        batch = pb.PageBatch.FromString(wire)
    except DecodeError:
        return
    batch.session = target.session
    with contextlib.suppress(InvalidTarget, CorruptCheckpoint):
        target.receiver.receive(target.session, frame_from(batch))


runs = st.lists(st.tuples(st.sampled_from(["pages-1.img", "pages-2.img", "../x", ""]),
                          st.integers(-3, 2**33), st.integers(-3, 2**33),
                          st.integers(-3, 2**33)), max_size=3)


@IO
@given(runs, st.integers(-1, 2**33), st.binary(max_size=64), st.booleans())
@example([("pages-1.img", 0, 0, 1)], 1, b"\x28\xb5\x2f\xfd" + b"\xff" * 8, False)
def test_any_frame_places_are_received_or_refused(
    target: _Target, places: list[tuple[str, int, int, int]], pages: int, data: bytes,
    raw: bool,
) -> None:
    frame = PageFrame(data, pages, tuple(places), raw=raw)
    with contextlib.suppress(InvalidTarget, CorruptCheckpoint):
        target.receiver.receive(target.session, frame)


@IO
@given(st.sampled_from(["pages-2.img", "pages-3.img", "../pages", "a" * 200, "x\0y", ""]),
       st.integers(0, 2**64 - 1), st.binary(max_size=80), st.integers(0, 2**32 - 1))
@example("pages-2.img", 2**64 - 1, b"", 0)
@example("pages-2.img", 2**62, b"", 0)
def test_any_offer_is_taken_or_refused(
    target: _Target, name: str, size: int, refs: bytes, first: int,
) -> None:
    """Found by the fuzzer: a declared size of 2**62 bytes allocated its references up
    front (MemoryError; 2**40 would have taken 4 GiB), one of 2**63 or more raised
    OverflowError from ftruncate."""
    try:
        missing = target.receiver.offer_pages(target.session, name, size, refs, first)
    except CkptdError:
        return
    assert all(first <= i < first + len(refs) // HASH_SIZE for i in missing)


@IO
@given(st.sampled_from(["core-1.img", "../core", "x\0y"]), fuzzed(
    _zstd_frame([b"core" * 100], content_size=False)), st.one_of(
    st.none(), st.integers(0, 2**64 - 1), st.just(400)))
@example("core-1.img", _zstd_frame([b"core" * 100], content_size=False), 2**45)
def test_any_whole_image_offer_is_taken_or_refused(
    target: _Target, name: str, data: bytes, size: int | None,
) -> None:
    """Found by the fuzzer: a declared size of 2**45 for a frame of unknown content size
    made zstd allocate it (MemoryError)."""
    try:
        target.receiver.offer_file(target.session, name, data, size)
    except CkptdError:
        return
