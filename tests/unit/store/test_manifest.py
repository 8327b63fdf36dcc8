"""Manifests: round trip, and any damage is refused (never half-read)."""

from __future__ import annotations

import json

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

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
    uid=st.integers(0, 2**32 - 1),
    files=st.lists(file_entries, max_size=6).map(tuple),
    packs=st.lists(hexes, max_size=4).map(tuple),
    blobs=st.lists(hexes, max_size=6).map(tuple),
)


@settings(max_examples=100, deadline=None)
@given(manifests)
def test_round_trip(manifest: Manifest) -> None:
    assert Manifest.from_bytes(manifest.to_bytes(), manifest.record.id) == manifest


@settings(max_examples=15, deadline=None)
@given(manifests)
def test_any_flipped_byte_is_refused(manifest: Manifest) -> None:
    data = manifest.to_bytes()
    for pos in range(len(data)):
        for mask in (0x01, 0x20, 0xFF):
            damaged = bytearray(data)
            damaged[pos] ^= mask
            with pytest.raises(CorruptCheckpoint) as info:
                Manifest.from_bytes(bytes(damaged), "ck-x")
            assert info.value.checkpoint_id == "ck-x"


@settings(max_examples=15, deadline=None)
@given(manifests)
def test_truncated_or_extended_is_refused(manifest: Manifest) -> None:
    data = manifest.to_bytes()
    for cut in range(len(data) - 1):  # dropping only the final newline is harmless
        with pytest.raises(CorruptCheckpoint):
            Manifest.from_bytes(data[:cut], "ck-x")
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_bytes(data + b"x", "ck-x")


def _sealed(body: object) -> bytes:
    raw = json.dumps(body).encode()
    return raw + b"\n" + xxhash.xxh3_128_hexdigest(raw).encode() + b"\n"


def test_a_manifest_of_another_format_is_refused_with_a_hint() -> None:
    with pytest.raises(CorruptCheckpoint, match=f"this ckptd reads {FORMAT}") as info:
        Manifest.from_bytes(_sealed({"format": FORMAT + 1}), "ck-x")
    assert info.value.hint == "upgrade ckptd"


EMPTY = {"uid": 0, "files": [], "packs": [], "blobs": []}


@pytest.mark.parametrize(
    "body",
    [
        {"format": FORMAT},
        {"format": FORMAT, "record": {}, **EMPTY},
        {"format": FORMAT, "record": {"id": "ck-x"}, **EMPTY, "files": [1]},
        {"format": FORMAT, "record": {}, **EMPTY, "uid": "root"},
    ],
)
def test_an_intact_but_incomplete_manifest_is_refused(body: object) -> None:
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        Manifest.from_bytes(_sealed(body), "ck-x")


@pytest.mark.parametrize(
    "body",
    [
        [FORMAT],
        {"format": FORMAT, "record": None, **EMPTY},
        {"format": FORMAT, "record": [], **EMPTY},
    ],
    ids=["list", "null-record", "list-record"],
)
def test_json_of_the_wrong_shape_is_refused(body: object) -> None:
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        Manifest.from_bytes(_sealed(body), "ck-x")


def test_not_json_with_a_good_checksum_is_refused() -> None:
    raw = b"\xff not json"
    data = raw + b"\n" + xxhash.xxh3_128_hexdigest(raw).encode() + b"\n"
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        Manifest.from_bytes(data, "ck-x")
