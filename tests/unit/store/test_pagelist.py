"""Page lists: full and delta encodings round-trip; damaged encodings are refused."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store import pagelist
from ckptd.core.store.pagehash import HASH_SIZE, ZERO_REF
from ckptd.errors import CorruptCheckpoint

BASE_HASH = bytes(range(16))

# references: zero pages, a small pool (so refs repeat) and fresh ones
pool = st.lists(st.binary(min_size=HASH_SIZE, max_size=HASH_SIZE), min_size=1, max_size=8)


@st.composite
def ref_lists(draw: st.DrawFn, max_size: int = 200) -> list[bytes]:
    common = draw(pool)
    one = st.one_of(
        st.just(ZERO_REF),
        st.sampled_from(common),
        st.binary(min_size=HASH_SIZE, max_size=HASH_SIZE),
    )
    return draw(st.lists(one, max_size=max_size))


@st.composite
def ref_and_base(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """A list and a base related to it: shifted, with pages changed, inserted, dropped,
    zeroed, or unrelated."""
    base = draw(ref_lists())
    refs = list(base)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["shift", "change", "insert", "drop", "zero", "fresh"]))
        if op == "fresh":
            refs = draw(ref_lists())
        elif op == "shift" and refs:
            k = draw(st.integers(0, len(refs) - 1))
            refs = refs[k:] + refs[:k]
        elif op in ("change", "zero", "drop") and refs:
            i = draw(st.integers(0, len(refs) - 1))
            if op == "drop":
                del refs[i]
            else:
                refs[i] = ZERO_REF if op == "zero" else draw(st.binary(min_size=16, max_size=16))
        elif op == "insert":
            i = draw(st.integers(0, len(refs)))
            refs.insert(i, draw(st.binary(min_size=16, max_size=16)))
    return refs, base


@settings(max_examples=150, deadline=None)
@given(ref_lists(max_size=400))
def test_full_round_trip(refs: list[bytes]) -> None:
    data = pagelist.encode_full(refs)
    assert pagelist.decode(data) == refs
    assert pagelist.base_of(data) is None


@settings(max_examples=150, deadline=None)
@given(ref_and_base())
def test_delta_round_trip(case: tuple[list[bytes], list[bytes]]) -> None:
    refs, base = case
    data = pagelist.encode_delta(refs, base, BASE_HASH)
    assert pagelist.base_of(data) == BASE_HASH
    assert pagelist.decode(data, base) == refs


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.binary(min_size=16, max_size=16), min_size=64, max_size=300, unique=True),
    st.data(),
)
def test_delta_is_small_when_refs_mostly_equal_the_base(
    base: list[bytes], data: st.DataObject
) -> None:
    refs = list(base)
    for _ in range(data.draw(st.integers(0, len(base) // 16))):
        i = data.draw(st.integers(0, len(refs) - 1))
        refs[i] = data.draw(st.sampled_from([ZERO_REF, bytes(range(1, 17))]))
    full = pagelist.encode_full(refs)
    delta = pagelist.encode_delta(refs, base, BASE_HASH)
    assert len(delta) * 2 < len(full)
    assert pagelist.decode(delta, base) == refs


@settings(max_examples=150, deadline=None)
@given(ref_and_base())
def test_decode_packed_gives_decode_s_references_packed(
    case: tuple[list[bytes], list[bytes]]
) -> None:
    """What a lazy restore holds (16 bytes a page) is ``decode``'s list, full or delta."""
    refs, base = case
    packed_base = b"".join(base)
    full = pagelist.encode_full(refs)
    assert pagelist.decode_packed(full, pages=len(refs)) == b"".join(refs)
    delta = pagelist.encode_delta(refs, base, BASE_HASH)
    assert pagelist.decode_packed(delta, packed_base, pages=len(refs)) == b"".join(refs)
    with pytest.raises(CorruptCheckpoint, match="base"):
        pagelist.decode_packed(delta)
    if any(r != ZERO_REF for r in refs) and len(base) > 1:
        short = packed_base[:HASH_SIZE]
        try:
            got = pagelist.decode_packed(delta, short)
        except CorruptCheckpoint as exc:
            assert "beyond" in exc.message
        else:  # the delta copied nothing past the first base reference
            assert got == b"".join(refs)


def test_zero_runs_are_collapsed() -> None:
    refs = [ZERO_REF] * 10_000
    assert len(pagelist.encode_full(refs)) < 32
    assert pagelist.decode(pagelist.encode_full(refs)) == refs


def test_a_delta_needs_its_base() -> None:
    refs = [bytes([1]) * 16, bytes([2]) * 16]
    with pytest.raises(CorruptCheckpoint, match="base"):
        pagelist.decode(pagelist.encode_delta(refs, refs, BASE_HASH))


def test_a_copy_beyond_its_base_is_refused() -> None:
    base = [bytes([n]) * 16 for n in range(1, 9)]
    data = pagelist.encode_delta(base, base, BASE_HASH)
    with pytest.raises(CorruptCheckpoint, match="beyond"):
        pagelist.decode(data, base[:4])


def _examples() -> dict[str, tuple[bytes, list[bytes] | None, list[bytes]]]:
    a, b, c, d = (bytes([n]) * 16 for n in (1, 2, 3, 4))
    refs = [a, b, ZERO_REF, ZERO_REF, c, a, b]
    base = [c, a, b, ZERO_REF]
    fresh = [a, b, d, d, ZERO_REF, c]
    return {
        "full": (pagelist.encode_full(refs), None, refs),
        "delta": (pagelist.encode_delta(refs, base, BASE_HASH), base, refs),
        "delta-literal": (pagelist.encode_delta(fresh, base, BASE_HASH), base, fresh),
        "delta-empty": (pagelist.encode_delta([], base, BASE_HASH), base, []),
        "zeros": (pagelist.encode_full([ZERO_REF] * 3), None, [ZERO_REF] * 3),
        "empty": (pagelist.encode_full([]), None, []),
    }


def _literal_payload_cuts(data: bytes) -> set[int]:
    """The lengths that cut ``data`` inside the payload of a LITERAL op."""
    kind, _count = struct.unpack_from("<BI", data, len(pagelist.MAGIC))
    pos = len(pagelist.MAGIC) + 5 + (HASH_SIZE if kind == pagelist.DELTA else 0)
    cuts: set[int] = set()
    while pos < len(data):
        op, n = struct.unpack_from("<BI", data, pos)
        pos += 5
        if op == pagelist.OP_LITERAL:
            cuts.update(range(pos, pos + n * HASH_SIZE))
            pos += n * HASH_SIZE
        elif op == pagelist.OP_COPY:
            pos += 4
    return cuts


def _decode_truncations(skip_literal_payloads: bool) -> list[str]:
    """What goes wrong when decoding every proper prefix of every example."""
    wrong = []
    for name, (data, base, refs) in _examples().items():
        skip = _literal_payload_cuts(data) if skip_literal_payloads else set()
        for cut in range(len(data)):
            if cut in skip:
                continue
            try:
                got = pagelist.decode(data[:cut], base)
            except CorruptCheckpoint:
                continue
            if got != refs:
                wrong.append(f"{name}[:{cut}] decoded to a wrong list")
    return wrong


def test_truncation_outside_literal_payloads_is_refused() -> None:
    """Cut in the magic, header, base hash, op headers or a copy's start: refused (or, for the
    empty delta cut inside its base hash, still the right, empty, list)."""
    assert _decode_truncations(skip_literal_payloads=True) == []


def test_truncation_at_every_length_is_refused() -> None:
    assert _decode_truncations(skip_literal_payloads=False) == []


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: b"XKPL1" + d[5:], "magic"),
        (lambda d: d[:5] + struct.pack("<BI", 0, 8) + d[10:], "page list"),  # count + 1
        (lambda d: d[:5] + struct.pack("<BI", 0, 6) + d[10:], "page list"),  # count - 1
        (lambda d: d + struct.pack("<BI", 7, 0), "page list"),  # unknown op
        (lambda d: d + struct.pack("<BI", pagelist.OP_COPY, 0) + bytes(4), "page list"),  # no base
        (lambda d: d + struct.pack("<BI", pagelist.OP_ZERO, 1), "page list"),  # one too many
        (lambda d: d + b"\0", "page list"),  # half an op
    ],
    ids=["bad-magic", "count+1", "count-1", "unknown-op", "copy-without-base", "extra-zero",
         "half-op"],
)
def test_damaged_full_lists_are_refused(mutate: Callable[[bytes], bytes], match: str) -> None:
    data, _base, _refs = _examples()["full"]
    with pytest.raises(CorruptCheckpoint, match=match):
        pagelist.decode(mutate(data))
