"""What MemoryBlobStore adds to the BlobStore contract (tests/contract): clock-stamped
mtimes, crash simulation and failure injection."""

from __future__ import annotations

import inspect

import pytest

from ckptd.core import ports
from ckptd.errors import BlobNotFound, StoreError
from ckptd.testing import FakeClock, MemoryBlobStore


def test_it_has_every_method_of_the_port_with_the_same_parameters() -> None:
    blobs = MemoryBlobStore()
    for name, value in vars(ports.BlobStore).items():
        if name.startswith("_") or not callable(value):
            continue
        want = list(inspect.signature(value).parameters)[1:]
        assert list(inspect.signature(getattr(blobs, name)).parameters) == want, name
    assert blobs.location.startswith("memory://")
    assert MemoryBlobStore(location="memory://x").location == "memory://x"


def test_mtimes_come_from_the_clock() -> None:
    clock = FakeClock()
    blobs = MemoryBlobStore(clock)
    blobs.put("a/1", b"x")
    clock.advance(10)
    blobs.put("a/2", b"y")
    assert blobs.put("a/1", b"z", if_absent=True) is False  # kept, and so is its time
    assert list(blobs.list("a/")) == [("a/1", clock.time() - 10), ("a/2", clock.time())]
    clock.advance(5)
    blobs.corrupt("a/2", 0)  # bit rot does not touch the mtime
    assert dict(blobs.list())["a/2"] == clock.time() - 5


def test_fail_put_after_counts_from_when_it_is_set() -> None:
    blobs = MemoryBlobStore()
    blobs.put("early", b"1")
    blobs.fail_put_after = 2
    assert blobs.put("k/1", b"1")
    assert blobs.put("k/1", b"again", if_absent=True) is False  # a put all the same
    for key in ("k/2", "k/3"):  # every later put fails, storing nothing
        with pytest.raises(StoreError, match="injected"):
            blobs.put(key, b"x")
    assert blobs.keys() == ["early", "k/1"]
    assert blobs.failed_puts == ["k/2", "k/3"]
    assert blobs.puts == ["early", "k/1"]
    blobs.fail_put_after = 0
    with pytest.raises(StoreError):
        blobs.put("k/4", b"x")
    blobs.fail_put_after = None
    assert blobs.put("k/4", b"x")


def test_fail_on_key_prefix() -> None:
    blobs = MemoryBlobStore()
    blobs.fail_on_key_prefix = "packs/"
    with pytest.raises(StoreError, match="packs/ab/1"):
        blobs.put("packs/ab/1", b"x")
    assert blobs.put("blobs/ab/1", b"x")
    assert not blobs.exists("packs/ab/1")
    blobs.fail_on_key_prefix = None
    assert blobs.put("packs/ab/1", b"x")


def test_on_put_runs_before_each_put() -> None:
    blobs = MemoryBlobStore()
    seen: list[tuple[str, bool]] = []
    blobs.on_put = lambda key: seen.append((key, blobs.exists(key)))
    blobs.put("a", b"1")
    blobs.put("a", b"2")
    assert seen == [("a", False), ("a", True)]


def test_corrupt_flips_one_byte() -> None:
    blobs = MemoryBlobStore()
    blobs.put("k", b"\x00\x01\x02")
    blobs.corrupt("k", 1)
    assert blobs.get("k") == b"\x00\xfe\x02"
    blobs.corrupt("k", -1, 0x01)
    assert blobs.get("k") == b"\x00\xfe\x03"
    with pytest.raises(ValueError, match="outside"):
        blobs.corrupt("k", 3)
    with pytest.raises(ValueError, match="mask"):
        blobs.corrupt("k", 0, 0)
    with pytest.raises(BlobNotFound):
        blobs.corrupt("missing", 0)


def test_crash_loses_what_was_not_flushed() -> None:
    blobs = MemoryBlobStore()
    blobs.put("kept", b"1")
    blobs.put("replaced", b"old")
    blobs.put("deleted", b"1")
    blobs.flush()
    blobs.put("lost", b"1")
    blobs.put("replaced", b"new")
    blobs.delete("deleted")
    assert blobs.flushes == 1
    blobs.crash()
    assert blobs.keys() == ["deleted", "kept", "replaced"]
    assert blobs.get("replaced") == b"old"
    blobs.crash()  # nothing more to lose
    assert blobs.keys() == ["deleted", "kept", "replaced"]


def test_a_crash_before_any_flush_loses_everything() -> None:
    blobs = MemoryBlobStore()
    blobs.put("a", b"1")
    blobs.crash()
    assert blobs.keys() == []
    assert blobs.total_bytes() == 0


@pytest.mark.parametrize("key", ["a//b", "./a", "a/.", "a/", "a/.tmp.123"])
def test_it_refuses_keys_a_directory_store_would_mangle(key: str) -> None:
    with pytest.raises(StoreError, match="invalid object key"):
        MemoryBlobStore().put(key, b"x")


def test_a_key_cannot_be_an_object_and_a_directory() -> None:
    blobs = MemoryBlobStore()
    blobs.put("a/b", b"x")
    with pytest.raises(StoreError, match="directory"):
        blobs.put("a", b"x")
    with pytest.raises(StoreError, match="not a directory"):
        blobs.put("a/b/c", b"x")
    assert blobs.keys() == ["a/b"]
