"""Page hashes: keyed per store secret and per uid; zero pages are ZERO_REF."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store.pagehash import HASH_SIZE, PAGE_SIZE, ZERO_PAGE, ZERO_REF, PageHasher

# a page from a short seed (hypothesis generates small inputs well), never the zero page
pages = (
    st.binary(min_size=1, max_size=64)
    .map(lambda b: (b * (PAGE_SIZE // len(b) + 1))[:PAGE_SIZE])
    .filter(lambda p: p != ZERO_PAGE)
)


@settings(max_examples=50)
@given(pages, st.integers(0, 2**31), st.integers(0, 2**31))
def test_another_uid_hashes_differently(page: bytes, uid: int, other: int) -> None:
    if uid == other:
        other += 1
    a, b = PageHasher(b"s" * 32, uid), PageHasher(b"s" * 32, other)
    assert a.page_ref(page) != b.page_ref(page)
    assert a.digest(page) != b.digest(page)


@settings(max_examples=50)
@given(pages, st.binary(min_size=1, max_size=32), st.binary(min_size=1, max_size=32))
def test_another_secret_hashes_differently(page: bytes, secret: bytes, other: bytes) -> None:
    if secret == other:
        other += b"!"
    assert PageHasher(secret, 0).page_ref(page) != PageHasher(other, 0).page_ref(page)


@settings(max_examples=50)
@given(pages)
def test_refs_are_stable_and_16_bytes(page: bytes) -> None:
    ref = PageHasher(b"k", 7).page_ref(page)
    assert len(ref) == HASH_SIZE
    assert ref != ZERO_REF
    assert PageHasher(b"k", 7).page_ref(memoryview(bytearray(page))) == ref
    assert PageHasher(b"k", 7).page_ref(memoryview(page)) == ref


@pytest.mark.parametrize("uid", [0, 1000, 2**31])
def test_the_zero_page_is_zero_ref_in_every_hash_space(uid: int) -> None:
    hasher = PageHasher(b"secret", uid)
    assert hasher.page_ref(ZERO_PAGE) == ZERO_REF
    assert hasher.page_ref(memoryview(bytearray(PAGE_SIZE))) == ZERO_REF
    assert hasher.zero == hasher.digest(ZERO_PAGE) != ZERO_REF
