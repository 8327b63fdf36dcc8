"""``LocalBlobStore.flush``: every object put since the last flush and every directory it was
added to is fsynced before flush returns — side by side (issue 25, the small job), never
fewer. The real store on a temporary directory; ``os.fsync`` observed, not replaced."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.errors import StoreError


class _Recorded:
    """Which paths were fsynced, by which threads, how many at the same time."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.threads: set[int] = set()
        self.busy = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def fsync(self, real: object, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            self.busy += 1
            self.most_at_once = max(self.most_at_once, self.busy)
            self.threads.add(threading.get_ident())
        try:
            time.sleep(0.01)  # a disk's commit: long enough for the others to start
            real(fd)  # type: ignore[operator]
        finally:
            with self._lock:
                self.busy -= 1
                self.paths.append(path)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorded:
    rec = _Recorded()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: rec.fsync(real, fd))
    return rec


def test_flush_fsyncs_every_object_and_directory_side_by_side(
    tmp_path: Path, recorded: _Recorded
) -> None:
    blobs = LocalBlobStore(tmp_path / "store")
    keys = [f"objects/{i:02x}/blob-{i}" for i in range(12)]
    for key in keys:
        blobs.put(key, key.encode())
    recorded.paths.clear()
    blobs.flush()
    synced = set(recorded.paths)
    root = (tmp_path / "store").resolve()
    for key in keys:
        assert str(root / key) in synced, key
        assert str((root / key).parent) in synced, key
    assert recorded.most_at_once > 1  # side by side, not one after the other
    assert len(recorded.threads) > 1
    recorded.paths.clear()
    blobs.flush()  # nothing new since: nothing fsynced again
    assert recorded.paths == []


def test_a_failed_fsync_fails_the_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = LocalBlobStore(tmp_path / "store")
    for i in range(4):
        blobs.put(f"objects/{i:02x}/blob-{i}", b"x")
    real = os.fsync
    failing = str((tmp_path / "store" / "objects" / "02" / "blob-2").resolve())

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == failing:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreError, match=r"cannot make the store durable: .*Input/output"):
        blobs.flush()

