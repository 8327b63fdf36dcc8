"""Contract of ``BlobStore``: every implementation behaves the same (see core/ports/)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ckptd.adapters.storage import LocalBlobStore
from ckptd.errors import BlobNotFound, StoreError

from .harness import BlobStoreHarness

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, every byte value


@pytest.mark.parametrize("data", [b"", b"x", DATA], ids=["empty", "one-byte", "10k"])
def test_put_get_round_trip(blobstore: BlobStoreHarness, data: bytes) -> None:
    blobs = blobstore.blobs
    assert blobs.put("packs/ab/abcdef", data) is True
    assert blobs.get("packs/ab/abcdef") == data
    assert blobs.size("packs/ab/abcdef") == len(data)
    assert blobs.exists("packs/ab/abcdef")
    assert blobstore.reopen().get("packs/ab/abcdef") == data


def test_put_parts_stores_the_parts_joined(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    parts = [DATA[:1], b"", memoryview(DATA)[1:5000], bytearray(DATA[5000:])]
    assert blobs.put_parts("packs/ab/parts", parts) is True
    assert blobstore.reopen().get("packs/ab/parts") == DATA
    assert blobs.put_parts("packs/ab/parts", [b"other"], if_absent=True) is False
    assert blobs.get("packs/ab/parts") == DATA
    many = [bytes([i % 256]) * 3 for i in range(3000)]  # more parts than one writev takes
    assert blobs.put_parts("packs/ab/many", many) is True
    assert blobs.get("packs/ab/many") == b"".join(many)


def test_put_replaces_an_object(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    blobs.put("store.json", b"old, longer")
    assert blobs.put("store.json", b"new") is True
    assert blobs.get("store.json") == b"new"
    assert blobs.size("store.json") == 3


@pytest.mark.parametrize(
    ("start", "end"),
    [(0, None), (0, 10), (5, 10), (100, None), (10240, 10244), (10243, None), (0, 10244),
     (7, 7), (10244, None), (10244, 10300), (10000, 20000), (20000, None), (20000, 30000)],
)
def test_ranged_get(blobstore: BlobStoreHarness, start: int, end: int | None) -> None:
    """``[start, end)``, clipped to the object: beyond its end is empty."""
    blobstore.blobs.put("k", DATA)
    assert blobstore.blobs.get("k", start, end) == DATA[start:end]


@pytest.mark.parametrize("start", [2**63 - 1, 2**63, 2**64 - 1])
def test_a_range_far_beyond_the_object_is_empty(
    blobstore: BlobStoreHarness, request: pytest.FixtureRequest, start: int
) -> None:
    """As a damaged pack footer may name (its trailer offset is a u64)."""
    blobstore.blobs.put("k", DATA)
    assert blobstore.blobs.get("k", start) == b""
    assert blobstore.blobs.get("k", start, start + 16) == b""


def test_if_absent_keeps_the_existing_object(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    assert blobs.put("blobs/ab/abc", b"first", if_absent=True) is True
    assert blobs.put("blobs/ab/abc", b"second, longer", if_absent=True) is False
    assert blobs.get("blobs/ab/abc") == b"first"
    assert blobs.size("blobs/ab/abc") == 5
    assert [k for k, _ in blobs.list("blobs/")] == ["blobs/ab/abc"]


def test_if_absent_has_one_winner_among_racing_puts(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    results: list[tuple[int, bool]] = []
    barrier = threading.Barrier(8)

    def race(n: int) -> None:
        barrier.wait()
        results.append((n, blobs.put("manifests/ck", f"writer {n}".encode(), if_absent=True)))

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [n for n, won in results if won]
    assert len(winners) == 1
    assert blobs.get("manifests/ck") == f"writer {winners[0]}".encode()


def test_size_and_exists(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    assert not blobs.exists("a/b")
    blobs.put("a/b", b"12345")
    assert blobs.exists("a/b")
    assert blobs.size("a/b") == 5
    assert not blobs.exists("a/bc")
    assert not blobs.exists("a/b/c")


def test_a_prefix_is_not_an_object(
    blobstore: BlobStoreHarness, request: pytest.FixtureRequest
) -> None:
    blobs = blobstore.blobs
    blobs.put("packs/ab/abc", b"x")
    assert not blobs.exists("packs")
    assert not blobs.exists("packs/ab")
    with pytest.raises(BlobNotFound):
        blobs.size("packs/ab")
    with pytest.raises(BlobNotFound):
        blobs.get("packs/ab")


KEYS = ["blobs/ab/ab12", "blobs/cd/cd34", "leases/ck-1", "manifests/ck-1", "manifests/ck-2",
        "packs/ab/ab99", "packs/ab/abba", "packs/ef/ef00", "store.json"]


def _fill(blobstore: BlobStoreHarness) -> None:
    for key in KEYS:
        blobstore.blobs.put(key, key.encode())


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("", KEYS),
        ("packs/", ["packs/ab/ab99", "packs/ab/abba", "packs/ef/ef00"]),
        ("packs/ab/", ["packs/ab/ab99", "packs/ab/abba"]),
        ("manifests/", ["manifests/ck-1", "manifests/ck-2"]),
        ("leases/", ["leases/ck-1"]),
        ("nothing/", []),
        ("packs/zz/", []),
        ("store.json", ["store.json"]),
        ("manifests/ck-1", ["manifests/ck-1"]),
    ],
)
def test_list_by_prefix(blobstore: BlobStoreHarness, prefix: str, expected: list[str]) -> None:
    _fill(blobstore)
    listed = list(blobstore.blobs.list(prefix))
    assert sorted(k for k, _ in listed) == expected
    now = time.time()
    assert all(isinstance(m, float) and abs(m - now) < 3600 for _, m in listed)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("packs/ab/ab", ["packs/ab/ab99", "packs/ab/abba"]),
        ("packs/a", ["packs/ab/ab99", "packs/ab/abba"]),
        ("manifests/ck-", ["manifests/ck-1", "manifests/ck-2"]),
        ("pa", ["packs/ab/ab99", "packs/ab/abba", "packs/ef/ef00"]),
    ],
)
def test_list_by_a_prefix_that_is_not_a_directory(
    blobstore: BlobStoreHarness, prefix: str, expected: list[str]
) -> None:
    _fill(blobstore)
    assert sorted(k for k, _ in blobstore.blobs.list(prefix)) == expected


def test_list_is_by_string_prefix_even_where_a_directory_matches(
    blobstore: BlobStoreHarness, request: pytest.FixtureRequest
) -> None:
    blobs = blobstore.blobs
    for key in ("packs/ab/1", "packs/abc/2", "packs/abd"):
        blobs.put(key, b"x")
    listed = sorted(k for k, _ in blobs.list("packs/ab"))
    assert listed == ["packs/ab/1", "packs/abc/2", "packs/abd"]


def test_list_shows_no_temporaries(blobstore: BlobStoreHarness) -> None:
    _fill(blobstore)
    for key in KEYS:
        blobstore.leave_temporary(key)
    for prefix in ("", "packs/", "packs/ab/", "manifests/"):
        assert not [k for k, _ in blobstore.blobs.list(prefix) if ".tmp." in k]
    assert sorted(k for k, _ in blobstore.blobs.list()) == KEYS


def test_delete_is_idempotent(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    _fill(blobstore)
    blobs.delete("packs/ab/abba")
    blobs.delete("packs/ab/abba")
    blobs.delete("never/was")
    assert not blobs.exists("packs/ab/abba")
    with pytest.raises(BlobNotFound):
        blobs.get("packs/ab/abba")
    assert sorted(k for k, _ in blobs.list("packs/")) == ["packs/ab/ab99", "packs/ef/ef00"]
    assert blobs.put("packs/ab/abba", b"back", if_absent=True) is True


def test_delete_while_listing(blobstore: BlobStoreHarness) -> None:
    """GC deletes what it lists."""
    _fill(blobstore)
    for key, _ in blobstore.blobs.list():
        blobstore.blobs.delete(key)
    assert list(blobstore.blobs.list()) == []


def test_missing_keys_raise_blob_not_found(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    blobs.put("packs/ab/abc", b"x")
    for key in ("packs/ab/abd", "nothing", "deep/er/still"):
        with pytest.raises(BlobNotFound) as info:
            blobs.get(key)
        assert isinstance(info.value, StoreError)
        assert key in str(info.value)
        with pytest.raises(BlobNotFound):
            blobs.get(key, 1, 2)
        with pytest.raises(BlobNotFound):
            blobs.size(key)


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../x", "a/../../x", "a/..", ".."])
def test_invalid_keys_are_refused(blobstore: BlobStoreHarness, key: str) -> None:
    blobs = blobstore.blobs
    with pytest.raises(StoreError):
        blobs.put(key, b"x")
    with pytest.raises(StoreError):
        blobs.get(key)
    with pytest.raises(StoreError):
        blobs.size(key)
    with pytest.raises(StoreError):
        blobs.exists(key)
    with pytest.raises(StoreError):
        blobs.delete(key)
    assert list(blobs.list()) == []


@pytest.mark.parametrize("prefix", ["../", "../x", "/", "/etc/", "a/../../"])
def test_invalid_prefixes_are_refused(
    blobstore: BlobStoreHarness, request: pytest.FixtureRequest, tmp_path: Path, prefix: str
) -> None:
    (tmp_path / "outside.txt").write_text("not an object")
    with pytest.raises(StoreError):
        list(blobstore.blobs.list(prefix))


def test_a_failed_put_leaves_nothing_visible(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    blobs.put("packs/ab/old", b"old content")
    with blobstore.failing_puts():
        for key in ("packs/ab/new", "packs/cd/new"):
            with pytest.raises(StoreError):
                blobs.put(key, DATA)
            with pytest.raises(StoreError):
                blobs.put(key + "2", DATA, if_absent=True)
        with pytest.raises(StoreError):
            blobs.put("packs/ab/old", DATA)
    for handle in (blobs, blobstore.reopen()):
        assert [k for k, _ in handle.list()] == ["packs/ab/old"]
        assert handle.get("packs/ab/old") == b"old content"
        for key in ("packs/ab/new", "packs/cd/new", "packs/ab/new2"):
            assert not handle.exists(key)
            with pytest.raises(BlobNotFound):
                handle.get(key)
    if isinstance(blobs, LocalBlobStore):  # and no temporary file stays behind either
        assert not [p for p in blobs.root.rglob("*") if p.name.startswith(".tmp.")]
    assert blobs.put("packs/ab/new", DATA) is True  # the store still works
    assert blobs.get("packs/ab/new") == DATA


def test_flush_may_be_called_any_time(blobstore: BlobStoreHarness) -> None:
    blobs = blobstore.blobs
    blobs.flush()
    blobs.put("a/b/c", b"1")
    blobs.put("a/d", b"2")
    blobs.flush()
    blobs.flush()
    blobs.delete("a/b/c")
    blobs.delete("missing")
    blobs.flush()
    again = blobstore.reopen()
    again.flush()
    assert [k for k, _ in again.list()] == ["a/d"]


def test_location_is_a_non_empty_string(blobstore: BlobStoreHarness) -> None:
    assert isinstance(blobstore.blobs.location, str)
    assert blobstore.blobs.location


# ---- LocalBlobStore only ---------------------------------------------------------------------


def test_remove_temporaries(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    blobs.put("packs/ab/abc", b"x")
    blobs.put("store.json", b"{}")
    for where in ("", "packs/", "packs/ab/", "blobs/cd/"):
        directory = blobs.root / where
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".tmp.deadbeef0000").write_bytes(b"half")
    assert blobs.remove_temporaries() == 4
    assert blobs.remove_temporaries() == 0
    assert not [p for p in blobs.root.rglob(".tmp.*")]
    assert sorted(k for k, _ in blobs.list()) == ["packs/ab/abc", "store.json"]


def test_local_put_resumes_a_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``writev`` may write less than asked (a signal, a full pipe of a FUSE store): the rest
    follows, from where it stopped, also inside a part."""
    import os

    real = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        first = buffers[0]
        return real(fd, [first[: max(1, first.nbytes // 3)]])

    monkeypatch.setattr("ckptd.adapters.storage.localfs.os.writev", short)
    blobs = LocalBlobStore(tmp_path / "blobs")
    blobs.put_parts("packs/ab/short", [DATA[:100], DATA[100:]])
    assert blobs.get("packs/ab/short") == DATA
    assert len(calls) > 2
