"""HPACK (RFC 7541), as much of it as ckptctl's gRPC client needs: header blocks encoded as
literals (never indexed, never Huffman-coded: every HPACK decoder reads them), and a complete
decoder (static and dynamic tables, table size updates, Huffman strings) for what the daemon's
gRPC server sends. Written here rather than taken from the ``hpack`` package, whose import
(with ``logging``) costs ~5 ms of a small ``ckptctl dump`` (issue 35);
tests/contract/test_hpack_decoder.py holds this decoder to ``hpack``'s on the blocks
``hpack``'s encoder makes.

Invariants: a block that does not decode whole and exactly (an index out of range, a string
past the end, bad Huffman padding, EOS inside a string, a size update above the limit or after
a field) raises :class:`HeaderError`; the dynamic table never holds more than its size (entry
size: name + value + 32, RFC 7541 4.1), evicting the oldest first.
"""

from __future__ import annotations

from collections import deque

STATIC = (
    (':authority', ''), (':method', 'GET'), (':method', 'POST'),
    (':path', '/'), (':path', '/index.html'), (':scheme', 'http'),
    (':scheme', 'https'), (':status', '200'), (':status', '204'),
    (':status', '206'), (':status', '304'), (':status', '400'),
    (':status', '404'), (':status', '500'), ('accept-charset', ''),
    ('accept-encoding', 'gzip, deflate'), ('accept-language', ''), ('accept-ranges', ''),
    ('accept', ''), ('access-control-allow-origin', ''), ('age', ''),
    ('allow', ''), ('authorization', ''), ('cache-control', ''),
    ('content-disposition', ''), ('content-encoding', ''), ('content-language', ''),
    ('content-length', ''), ('content-location', ''), ('content-range', ''),
    ('content-type', ''), ('cookie', ''), ('date', ''),
    ('etag', ''), ('expect', ''), ('expires', ''),
    ('from', ''), ('host', ''), ('if-match', ''),
    ('if-modified-since', ''), ('if-none-match', ''), ('if-range', ''),
    ('if-unmodified-since', ''), ('last-modified', ''), ('link', ''),
    ('location', ''), ('max-forwards', ''), ('proxy-authenticate', ''),
    ('proxy-authorization', ''), ('range', ''), ('referer', ''),
    ('refresh', ''), ('retry-after', ''), ('server', ''),
    ('set-cookie', ''), ('strict-transport-security', ''), ('transfer-encoding', ''),
    ('user-agent', ''), ('vary', ''), ('via', ''),
    ('www-authenticate', ''),
)
"""RFC 7541 Appendix A: index 1 is STATIC[0]."""

_HUFFMAN_LENGTHS = bytes.fromhex(
    "0d171c1c1c1c1c1c1c181e1c1c1e1c1c1c1c1c1c1c1c1e1c1c1c1c1c1c1c1c1c060a0a0c0d06080b0a0a080b"
    "080606060505050606060606060607080f060c0a0d0607070707070707070707070707070707070707070707"
    "0807080d130d0e060f05060506050606060507070606060506070605050607070707070f0b0e0d1c14161414"
    "1616161716171717171718171818161718171717171516171617171816151416161717151716161815161717"
    "151516151716171714161616171616171a1a1413161716191a1a1a1b1b1a181913151a1b1b1a1b1815151a1a"
    "1c1b1b1b14181415161515171616191918181a171a1b1a1a1b1b1b1b1b1c1b1b1b1b1b1a1e"
)
"""RFC 7541 Appendix B: each symbol's code length (0-255, then EOS = 256). The code is
canonical (codes assigned in order of length, then symbol), so the lengths define it."""

EOS = 256


class HeaderError(ValueError):
    """A header block that is not valid HPACK."""


def _huffman_codes() -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, the canonical code of _HUFFMAN_LENGTHS."""
    table: dict[tuple[int, int], int] = {}
    code = -1
    prev = 0
    for symbol in sorted(range(257), key=lambda s: (_HUFFMAN_LENGTHS[s], s)):
        length = _HUFFMAN_LENGTHS[symbol]
        code = (code + 1) << (length - prev) if code >= 0 else 0
        prev = length
        table[(length, code)] = symbol
    return table


_CODES: list[dict[tuple[int, int], int]] = []
"""The code table, made at the first Huffman string (most blocks have none)."""


def huffman_decode(data: bytes) -> bytes:
    """A Huffman-coded string decoded; padding must be the EOS prefix (1 bits), < 8 bits."""
    if not _CODES:
        _CODES.append(_huffman_codes())
    codes = _CODES[0]
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            symbol = codes.get((length, code))
            if symbol is not None:
                if symbol == EOS:
                    raise HeaderError("EOS in a Huffman-coded string")
                out.append(symbol)
                code = length = 0
            elif length > 30:
                raise HeaderError("a Huffman code longer than any")
    if length > 7 or code != (1 << length) - 1:
        raise HeaderError("bad padding in a Huffman-coded string")
    return bytes(out)


def _integer(block: bytes, at: int, prefix: int) -> tuple[int, int]:
    """The integer with a ``prefix``-bit prefix at ``block[at]`` and the offset after it."""
    if at >= len(block):
        raise HeaderError("the block ends inside an integer")
    mask = (1 << prefix) - 1
    value = block[at] & mask
    at += 1
    if value < mask:
        return value, at
    shift = 0
    while True:
        if at >= len(block):
            raise HeaderError("the block ends inside an integer")
        byte = block[at]
        at += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at
        if shift > 63:
            raise HeaderError("an integer too large")


def _string(block: bytes, at: int) -> tuple[bytes, int]:
    if at >= len(block):
        raise HeaderError("the block ends before a string")
    huffman = bool(block[at] & 0x80)
    size, at = _integer(block, at, 7)
    if at + size > len(block):
        raise HeaderError("a string runs past the block's end")
    raw = block[at:at + size]
    return (huffman_decode(raw) if huffman else raw), at + size


def _encode_integer(value: int, prefix: int, first: int = 0) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block: each field a literal without indexing, its name and value plain."""
    out = bytearray()
    for name, value in headers:
        out.append(0x00)
        out += _encode_integer(len(name), 7) + name
        out += _encode_integer(len(value), 7) + value
    return bytes(out)


class Decoder:
    """Decodes the header blocks of one connection, in order (they share the dynamic table).
    ``max_size``: the table size this side allows (SETTINGS_HEADER_TABLE_SIZE)."""

    def __init__(self, max_size: int = 4096) -> None:
        self.max_size = max_size
        self._size = max_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._used = 0

    def _field(self, index: int) -> tuple[bytes, bytes]:
        if index <= 0:
            raise HeaderError("header index 0")
        if index <= len(STATIC):
            name, value = STATIC[index - 1]
            return name.encode(), value.encode()
        dynamic = index - len(STATIC) - 1
        if dynamic >= len(self._table):
            raise HeaderError(f"header index {index} beyond the tables")
        return self._table[dynamic]

    def _evict(self) -> None:
        while self._used > self._size and self._table:
            name, value = self._table.pop()
            self._used -= len(name) + len(value) + 32

    def _add(self, name: bytes, value: bytes) -> None:
        self._table.appendleft((name, value))
        self._used += len(name) + len(value) + 32
        self._evict()

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        fields: list[tuple[bytes, bytes]] = []
        at = 0
        while at < len(block):
            byte = block[at]
            if byte & 0x80:  # indexed field
                index, at = _integer(block, at, 7)
                fields.append(self._field(index))
                continue
            if byte & 0xE0 == 0x20:  # dynamic table size update
                if fields:
                    raise HeaderError("a table size update after a header field")
                size, at = _integer(block, at, 5)
                if size > self.max_size:
                    raise HeaderError(f"table size {size} above the {self.max_size} allowed")
                self._size = size
                self._evict()
                continue
            indexing = bool(byte & 0x40)  # else without indexing (0x00) or never (0x10)
            index, at = _integer(block, at, 6 if indexing else 4)
            if index:
                name = self._field(index)[0]
            else:
                name, at = _string(block, at)
            value, at = _string(block, at)
            if indexing:
                self._add(name, value)
            fields.append((name, value))
        return fields
