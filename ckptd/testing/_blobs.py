"""``MemoryBlobStore``: a ``BlobStore`` whose objects live in a dict."""

from __future__ import annotations

import builtins
import errno
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn

from ckptd.errors import BlobNotFound, StoreError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ckptd.core.ports import BlobStore, Clock

PutHook = Callable[[str], None]


class MemoryBlobStore:
    """A ``BlobStore`` (see ``ckptd.core.ports``) keeping objects in memory.

    Behaviour, like ``LocalBlobStore``:

    - keys are ``/``-separated relative names; an empty, absolute or ``..`` key raises
      ``StoreError`` (this fake is stricter: empty and ``.`` components, and names starting
      with ``.tmp.`` — LocalBlobStore's temporaries — are refused too); a key cannot be both
      an object and the directory of another (``a`` and ``a/b``): ``StoreError``, as on disk;
    - ``put`` stores the whole object or nothing; with ``if_absent`` an existing object is
      kept and ``put`` returns False; each put stamps the object with ``clock.time()``
      (``time.time()`` without a clock), which ``list`` reports as its modified time;
    - ``get(key, start, end)`` returns ``data[start:end]``; ``get``/``size`` of a missing
      key raise ``BlobNotFound``; ``delete`` of a missing key does nothing;
    - ``list(prefix)`` yields ``(key, mtime)`` of every key starting with ``prefix``, sorted,
      from a snapshot (deleting while iterating is fine).

    Durability: ``flush`` records what exists as durable; ``crash()`` then throws away every
    change (put or delete) made since the last ``flush``, as a power cut would.

    Failure injection (for crash tests):

    - ``fail_put_after = n``: the next ``n`` puts succeed, every later one raises
      ``StoreError`` without storing anything (counted from when it is set; None: off);
    - ``fail_on_key_prefix = "packs/"``: every put of a key with that prefix raises;
    - ``fail_errno = errno.ENOSPC``: those injected failures are raised from an ``OSError``
      with that errno, as ``LocalBlobStore`` raises them (None: from nothing);
    - ``capacity = n``: a full file system of ``n`` bytes: a put that would make the objects
      (the one it replaces still counted, as a temporary file renamed over it needs room
      first) hold more raises ``StoreError`` from ``OSError(ENOSPC)``; deletes free room;
    - ``on_put(key)``: called before each put is carried out (to interleave another
      operation, e.g. a GC from another node, at an exact point);
    - ``corrupt(key, offset)`` flips bits of one byte of a stored object.

    Records: ``puts`` (every key put successfully, in order), ``failed_puts``, ``flushes``.
    Thread-safe.
    """

    def __init__(self, clock: Clock | None = None, *, location: str = "") -> None:
        self._clock = clock
        self.location = location or f"memory://{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._durable: dict[str, tuple[bytes, float]] = {}
        self._fail_put_after: int | None = None
        self._puts_since_armed = 0
        self.fail_on_key_prefix: str | None = None
        self.fail_errno: int | None = None
        self.capacity: int | None = None
        self.on_put: PutHook | None = None
        self.puts: builtins.list[str] = []
        self.failed_puts: builtins.list[str] = []
        self.flushes = 0

    # ---- failure injection and inspection ------------------------------------------------

    @property
    def fail_put_after(self) -> int | None:
        """How many more puts succeed before every put fails (None: no limit)."""
        return self._fail_put_after

    @fail_put_after.setter
    def fail_put_after(self, value: int | None) -> None:
        with self._lock:
            self._fail_put_after = value
            self._puts_since_armed = 0

    def corrupt(self, key: str, offset: int, mask: int = 0xFF) -> None:
        """XOR the byte at ``offset`` (negative: from the end) of ``key`` with ``mask``; the
        object keeps its modified time, as with bit rot."""
        if not 0 < mask < 256:
            raise ValueError(f"mask must be 1..255, not {mask}")
        with self._lock:
            data, mtime = self._stored(key)
            if not -len(data) <= offset < len(data):
                raise ValueError(f"offset {offset} is outside {key} ({len(data)} bytes)")
            buf = bytearray(data)
            buf[offset] ^= mask
            self._objects[key] = (bytes(buf), mtime)

    def crash(self) -> None:
        """Lose every put and delete since the last ``flush``."""
        with self._lock:
            self._objects = dict(self._durable)

    def keys(self) -> builtins.list[str]:
        """Every key, sorted."""
        with self._lock:
            return sorted(self._objects)

    def total_bytes(self) -> int:
        """The size of all objects together."""
        with self._lock:
            return sum(len(data) for data, _ in self._objects.values())

    # ---- the BlobStore port --------------------------------------------------------------

    def put_parts(self, key: str, parts: Sequence[Buffer], *, if_absent: bool = False) -> bool:
        """``put`` of the parts joined."""
        return self.put(key, b"".join(parts), if_absent=if_absent)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Store ``data`` under ``key`` whole; with ``if_absent``, keep an existing object
        and return False."""
        _check_key(key)
        hook = self.on_put
        if hook is not None:
            hook(key)
        data = bytes(data)
        with self._lock:
            limit = self._fail_put_after
            if limit is not None and self._puts_since_armed >= limit:
                self._fail(key, "injected failure (fail_put_after)", self.fail_errno)
            if self.fail_on_key_prefix is not None and key.startswith(self.fail_on_key_prefix):
                self._fail(key, "injected failure (fail_on_key_prefix)", self.fail_errno)
            if self.capacity is not None and (
                sum(len(d) for d, _ in self._objects.values()) + len(data) > self.capacity
            ):
                self._fail(key, f"no room left ({self.capacity} bytes)", errno.ENOSPC)
            self._check_no_clash(key)
            if limit is not None:
                self._puts_since_armed += 1
            if if_absent and key in self._objects:
                return False
            self._objects[key] = (data, self._now())
            self.puts.append(key)
            return True

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object."""
        _check_key(key)
        with self._lock:
            data, _ = self._stored(key)
        return data[start:end]

    def size(self, key: str) -> int:
        _check_key(key)
        with self._lock:
            return len(self._stored(key)[0])

    def exists(self, key: str) -> bool:
        _check_key(key)
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        """``(key, modified time)`` of every object whose key starts with ``prefix``."""
        if prefix:
            _check_key(prefix.removesuffix("/"))
        with self._lock:
            snapshot = sorted(
                (key, mtime) for key, (_, mtime) in self._objects.items() if key.startswith(prefix)
            )
        yield from snapshot

    def delete(self, key: str) -> None:
        """Remove ``key``; nothing happens if it does not exist."""
        _check_key(key)
        with self._lock:
            self._objects.pop(key, None)

    def flush(self) -> None:
        """Make everything put or deleted so far survive ``crash``."""
        with self._lock:
            self._durable = dict(self._objects)
            self.flushes += 1

    # ---- internals -----------------------------------------------------------------------

    def _fail(self, key: str, why: str, code: int | None) -> NoReturn:
        self.failed_puts.append(key)
        cause = OSError(code, os.strerror(code)) if code is not None else None
        raise StoreError(f"cannot write {key}: {why}") from cause

    def _now(self) -> float:
        return self._clock.time() if self._clock is not None else time.time()

    def _stored(self, key: str) -> tuple[bytes, float]:
        try:
            return self._objects[key]
        except KeyError:
            raise BlobNotFound(f"object {key} not found in {self.location}") from None

    def _check_no_clash(self, key: str) -> None:
        parts = key.split("/")
        for n in range(1, len(parts)):
            parent = "/".join(parts[:n])
            if parent in self._objects:
                raise StoreError(f"cannot write {key}: {parent} is an object, not a directory")
        below = key + "/"
        if any(k.startswith(below) for k in self._objects):
            raise StoreError(f"cannot write {key}: it is a directory of other objects")


def _check_key(key: str) -> None:
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or parts[-1].startswith(".tmp.")
    ):
        raise StoreError(f"invalid object key {key!r}")


if TYPE_CHECKING:

    def _is_a_blob_store(store: MemoryBlobStore) -> BlobStore:
        return store
