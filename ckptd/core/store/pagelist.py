"""Page lists: the ordered page references of one CRIU pages image, compactly encoded.

A list is either *full* (every reference, with runs of zero pages collapsed) or a *delta*
against one full list (its base): runs copied from the base (matched by content, so pages
that moved still match), zero runs, and literal references. A delta's base is always full,
so decoding reads at most two lists: every checkpoint restores on its own.

Encoding: b"CKPL1", u8 kind (0 full, 1 delta), u32 count, [16-byte base hash if delta], then
ops: u8 op, u32 n, payload — op 0 LITERAL (n refs of 16 bytes), op 1 ZERO (no payload),
op 2 COPY (u32 start in base). The whole is zstd-compressed by the store.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import overload

from ckptd.core.store.pagehash import HASH_SIZE, ZERO_REF
from ckptd.errors import CorruptCheckpoint

MAGIC = b"CKPL1"
FULL, DELTA = 0, 1
OP_LITERAL, OP_ZERO, OP_COPY = 0, 1, 2
_OP = struct.Struct("<BI")
_HEAD = struct.Struct("<BI")


class Refs(Sequence[bytes]):
    """The references packed in ``raw`` (16 bytes each, as ``pagepath.hash_pages`` gives them)
    as a sequence: a page list held as 16 bytes a page, an object made only per item read
    (issue #13)."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes | bytearray) -> None:
        if len(raw) % HASH_SIZE:
            raise ValueError(f"references of {len(raw)} bytes are not a whole number")
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw) // HASH_SIZE

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("reference index out of range")
        return bytes(self.raw[i * HASH_SIZE : (i + 1) * HASH_SIZE])


_ZERO_BLOCK = 1024
_ZEROS = bytes(HASH_SIZE * _ZERO_BLOCK)


def encode_full(refs: Sequence[bytes] | bytes | bytearray) -> bytes:
    """The full list of ``refs``: a sequence of references or, without an object per page,
    ``bytes``/``bytearray`` of them concatenated (the same encoding either way)."""
    if isinstance(refs, bytes | bytearray):
        return _encode_full_packed(refs)
    out = [MAGIC, _HEAD.pack(FULL, len(refs))]
    i = 0
    n = len(refs)
    while i < n:
        j = i
        if refs[i] == ZERO_REF:
            while j < n and refs[j] == ZERO_REF:
                j += 1
            out.append(_OP.pack(OP_ZERO, j - i))
        else:
            while j < n and refs[j] != ZERO_REF:
                j += 1
            out.append(_OP.pack(OP_LITERAL, j - i))
            out.append(b"".join(refs[i:j]))
        i = j
    return b"".join(out)


def _encode_full_packed(raw: bytes | bytearray) -> bytes:
    if len(raw) % HASH_SIZE:
        raise ValueError(f"references of {len(raw)} bytes are not a whole number")
    n = len(raw) // HASH_SIZE
    view = memoryview(raw)  # literal runs joined from it: one copy, not three
    out: list[bytes | memoryview] = [MAGIC, _HEAD.pack(FULL, n)]
    i = 0
    while i < n:
        z = _next_zero(raw, i)
        if z > i:
            out.append(_OP.pack(OP_LITERAL, z - i))
            out.append(view[i * HASH_SIZE : z * HASH_SIZE])
        if z == n:
            break
        j = z + 1
        while j + _ZERO_BLOCK <= n and raw.startswith(_ZEROS, j * HASH_SIZE):
            j += _ZERO_BLOCK
        while j < n and raw.startswith(ZERO_REF, j * HASH_SIZE):
            j += 1
        out.append(_OP.pack(OP_ZERO, j - z))
        i = j
    try:
        return b"".join(out)
    finally:
        out.clear()  # the slices first: then ``raw`` (a bytearray) may be resized again
        view.release()


def _next_zero(raw: bytes | bytearray, i: int) -> int:
    """The first reference from the ``i``-th that is ZERO_REF (aligned), or the count."""
    pos = raw.find(ZERO_REF, i * HASH_SIZE)
    while pos != -1 and pos % HASH_SIZE:
        pos = raw.find(ZERO_REF, (pos // HASH_SIZE + 1) * HASH_SIZE)
    return len(raw) // HASH_SIZE if pos == -1 else pos // HASH_SIZE


def encode_delta(refs: Sequence[bytes], base: Sequence[bytes], base_hash: bytes) -> bytes:
    """Encode ``refs`` against the full list ``base`` (named by ``base_hash``)."""
    where: dict[bytes, int] = {}
    for pos, ref in enumerate(base):
        if ref != ZERO_REF:
            where.setdefault(ref, pos)
    out = [MAGIC, _HEAD.pack(DELTA, len(refs)), base_hash]
    literal: list[bytes] = []

    def flush_literal() -> None:
        if literal:
            out.append(_OP.pack(OP_LITERAL, len(literal)))
            out.append(b"".join(literal))
            literal.clear()

    i, n, nb = 0, len(refs), len(base)
    while i < n:
        ref = refs[i]
        if ref == ZERO_REF:
            j = i
            while j < n and refs[j] == ZERO_REF:
                j += 1
            flush_literal()
            out.append(_OP.pack(OP_ZERO, j - i))
            i = j
            continue
        start = where.get(ref)
        if start is None:
            literal.append(ref)
            i += 1
            continue
        length = 1
        while i + length < n and start + length < nb and refs[i + length] == base[start + length]:
            if refs[i + length] == ZERO_REF:
                break
            length += 1
        flush_literal()
        out.append(_OP.pack(OP_COPY, length) + struct.pack("<I", start))
        i += length
    flush_literal()
    return b"".join(out)


def base_of(data: bytes) -> bytes | None:
    """The base hash of a delta list, None for a full one."""
    _check(data)
    start = len(MAGIC) + _HEAD.size
    if len(data) < start:
        raise CorruptCheckpoint("page list: truncated (no header)")
    kind, _ = _HEAD.unpack_from(data, len(MAGIC))
    if not kind:
        return None
    if len(data) < start + HASH_SIZE:
        raise CorruptCheckpoint("page list: truncated (no base hash)")
    return data[start : start + HASH_SIZE]


def _check(data: bytes) -> None:
    if not data.startswith(MAGIC):
        raise CorruptCheckpoint("page list: bad magic")


def decode_full_packed(data: bytes, *, pages: int | None = None) -> bytes:
    """The references of the full list ``data``, concatenated (16 bytes a page: a delta's
    base without an object per page); checked as ``decode`` checks it. A delta list raises
    CorruptCheckpoint (a base is always full)."""
    return decode_packed(data, pages=pages)


def decode_packed(data: bytes, base: bytes | None = None, *, pages: int | None = None
                  ) -> bytes:
    """``decode``'s references concatenated (16 bytes a page, no object per page; a lazy
    restore holds a whole image's this way); a delta needs its base decoded the same way."""
    _check(data)
    try:
        kind, count = _HEAD.unpack_from(data, len(MAGIC))
        if pages is not None and count != pages:
            raise CorruptCheckpoint(f"page list: header says {count} references, not {pages}")
        pos = len(MAGIC) + _HEAD.size
        if kind == DELTA:
            if base is None:
                raise CorruptCheckpoint("page list: delta without its base")
            pos += HASH_SIZE
        parts: list[bytes] = []
        have = 0
        while pos < len(data):
            op, n = _OP.unpack_from(data, pos)
            pos += _OP.size
            if have + n > count:
                raise CorruptCheckpoint(
                    f"page list: more references than the header says ({count})"
                )
            if op == OP_LITERAL:
                end = pos + n * HASH_SIZE
                if end > len(data):
                    raise CorruptCheckpoint("page list: truncated (literal references cut short)")
                parts.append(data[pos:end])
                pos = end
            elif op == OP_ZERO:
                parts.append(bytes(n * HASH_SIZE))
            elif op == OP_COPY and kind == DELTA and base is not None:
                (start,) = struct.unpack_from("<I", data, pos)
                pos += 4
                if (start + n) * HASH_SIZE > len(base):
                    raise CorruptCheckpoint("page list: copy beyond its base")
                parts.append(base[start * HASH_SIZE:(start + n) * HASH_SIZE])
            else:
                raise CorruptCheckpoint(f"page list: bad op {op}")
            have += n
    except struct.error as exc:
        raise CorruptCheckpoint(f"page list: truncated ({exc})") from exc
    if have != count:
        raise CorruptCheckpoint(f"page list: {have} references, header says {count}")
    return b"".join(parts)


def decode(
    data: bytes, base: Sequence[bytes] | None = None, *, pages: int | None = None
) -> list[bytes]:
    """The references of ``data``; a delta needs its decoded ``base``. ``pages``: how many
    the caller knows it holds (its manifest entry's), checked against the header before
    anything is built, so a header declaring billions of zero pages allocates nothing."""
    _check(data)
    try:
        kind, count = _HEAD.unpack_from(data, len(MAGIC))
        if pages is not None and count != pages:
            raise CorruptCheckpoint(f"page list: header says {count} references, not {pages}")
        pos = len(MAGIC) + _HEAD.size
        if kind == DELTA:
            pos += HASH_SIZE
            if base is None:
                raise CorruptCheckpoint("page list: delta without its base")
        refs: list[bytes] = []
        while pos < len(data):
            op, n = _OP.unpack_from(data, pos)
            pos += _OP.size
            if len(refs) + n > count:
                raise CorruptCheckpoint(
                    f"page list: more references than the header says ({count})"
                )
            if op == OP_LITERAL:
                end = pos + n * HASH_SIZE
                if end > len(data):
                    raise CorruptCheckpoint("page list: truncated (literal references cut short)")
                refs.extend(data[p : p + HASH_SIZE] for p in range(pos, end, HASH_SIZE))
                pos = end
            elif op == OP_ZERO:
                refs.extend([ZERO_REF] * n)
            elif op == OP_COPY and base is not None:
                (start,) = struct.unpack_from("<I", data, pos)
                pos += 4
                if start + n > len(base):
                    raise CorruptCheckpoint("page list: copy beyond its base")
                refs.extend(base[start : start + n])
            else:
                raise CorruptCheckpoint(f"page list: bad op {op}")
    except struct.error as exc:
        raise CorruptCheckpoint(f"page list: truncated ({exc})") from exc
    if len(refs) != count:
        raise CorruptCheckpoint(f"page list: {len(refs)} references, header says {count}")
    return refs
