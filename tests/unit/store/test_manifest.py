"""Manifests: round trip, and any damage is refused (never half-read); authentication (ADR
0013) is tested in test_tamper.py."""

from __future__ import annotations

import json

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.manifest import FORMAT, FileEntry, Manifest
from ckptd.errors import CorruptCheckpoint

from ..test_model import records

hexes = st.binary(min_size=16, max_size=16).map(bytes.hex)
names = st.text(min_size=1, max_size=30)
sizes = st.integers(0, 2**40)
file_entries = st.one_of(
    st.builds(FileEntry, name=names, size=sizes, blob=hexes),
    st.builds(
        FileEntry,
        name=names,
        size=sizes,
        pagelist=hexes,
        pagelist_base=st.just("") | hexes,
        pages=st.integers(0, 2**28),
    ),
)
manifests = st.builds(
    Manifest,
    record=records,
    uid=st.just(0),
    files=st.lists(file_entries, max_size=6).map(tuple),
    packs=st.lists(hexes, max_size=4).map(tuple),
    blobs=st.lists(hexes, max_size=6).map(tuple),
).map(lambda m: Manifest(m.record, m.record.uid, m.files, m.packs, m.blobs))
KEYS = ManifestKeys.generate()
STORE = "store-1"


def read(data: bytes, name: str) -> Manifest:
    return Manifest.from_bytes(data, name, KEYS, STORE)


@settings(max_examples=100, deadline=None)
@given(manifests)
def test_round_trip(manifest: Manifest) -> None:
    assert read(manifest.to_bytes(KEYS, STORE), manifest.record.id) == manifest


@settings(max_examples=15, deadline=None)
@given(manifests)
def test_any_flipped_byte_is_refused(manifest: Manifest) -> None:
    data = manifest.to_bytes(KEYS, STORE)
    name = manifest.record.id
    for pos in range(len(data)):
        for mask in (0x01, 0x20, 0xFF):
            damaged = bytearray(data)
            damaged[pos] ^= mask
            if pos == len(data) - 1 and bytes(damaged).rstrip(b"\n") == data.rstrip(b"\n"):
                continue  # the final newline flipped to another trailing newline
            with pytest.raises(CorruptCheckpoint) as info:
                read(bytes(damaged), name)
            assert info.value.checkpoint_id == name


@settings(max_examples=15, deadline=None)
@given(manifests)
def test_truncated_or_extended_is_refused(manifest: Manifest) -> None:
    data = manifest.to_bytes(KEYS, STORE)
    name = manifest.record.id
    for cut in range(len(data) - 1):  # dropping only the final newline is harmless
        with pytest.raises(CorruptCheckpoint):
            read(data[:cut], name)
    with pytest.raises(CorruptCheckpoint):
        read(data + b"x", name)


def _sealed(body: object) -> bytes:
    """``body`` as an authentic manifest (what a node holding KEYS would have written)."""
    raw = json.dumps(body).encode()
    kid, mac = KEYS.sign(raw)
    return raw + b"\n" + f"{kid} {mac}".encode() + b"\n"


def test_a_manifest_of_another_format_is_refused_with_a_hint() -> None:
    with pytest.raises(CorruptCheckpoint, match=f"this ckptd reads {FORMAT}") as info:
        read(_sealed({"format": FORMAT + 1, "id": "ck-x", "store": STORE}), "ck-x")
    assert info.value.hint == "upgrade ckptd"


def test_a_format_1_manifest_is_refused_as_unauthenticated() -> None:
    raw = json.dumps({"format": 1}).encode()
    data = raw + b"\n" + xxhash.xxh3_128_hexdigest(raw).encode() + b"\n"
    with pytest.raises(CorruptCheckpoint, match="ck-x is not authenticated") as info:
        read(data, "ck-x")
    assert "adopt_unauthenticated" in info.value.hint


EMPTY = {"format": FORMAT, "id": "ck-x", "store": STORE, "uid": 0, "files": [], "packs": [],
         "blobs": []}


@pytest.mark.parametrize(
    "body",
    [
        {"format": FORMAT, "id": "ck-x", "store": STORE},
        {"record": {}, **EMPTY},
        {"record": {"id": "ck-x"}, **EMPTY, "files": [1]},
        {"record": {}, **EMPTY, "uid": "root"},
    ],
)
def test_an_intact_but_incomplete_manifest_is_refused(body: object) -> None:
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        read(_sealed(body), "ck-x")


@pytest.mark.parametrize(
    "body",
    [
        [FORMAT],
        {"record": None, **EMPTY},
        {"record": [], **EMPTY},
    ],
    ids=["list", "null-record", "list-record"],
)
def test_json_of_the_wrong_shape_is_refused(body: object) -> None:
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        read(_sealed(body), "ck-x")


def test_not_json_with_a_good_mac_is_refused() -> None:
    raw = b"\xff not json"
    kid, mac = KEYS.sign(raw)
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        read(raw + b"\n" + f"{kid} {mac}".encode() + b"\n", "ck-x")
