"""The keys that authenticate manifests (HMAC-SHA256, docs/adr/0014-authenticated-manifests.md).

A node holds a list of keys: the first signs every manifest it writes; every one of them is
accepted when a manifest is read (key rotation: add the new key on every node, then make it
the first, then drop the old one once no manifest it signed is kept). Each key has a public
*key id* (a hash of the key, never the key): a manifest names the id of the key that signed
it, so a manifest signed with a key this node lacks is told apart from an edited one.

Invariants: keys are 32 random bytes; the signing key is always one of the accepted keys;
key ids are distinct; MACs are compared in constant time. Where the keys are kept (a file
outside the store, mode 0600) is the daemon's business, not the core's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_SIZE = 32
MAC_DOMAIN = b"ckptd-manifest-v2\0"


def key_id(key: bytes) -> str:
    """The public name of ``key``: 16 hex digits of a hash of it (reveals nothing of it)."""
    return hashlib.sha256(b"ckptd-manifest-key-id\0" + key).hexdigest()[:16]


@dataclass(frozen=True)
class ManifestKeys:
    """``keys[0]`` signs; all of ``keys`` are accepted."""

    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("no manifest key")
        for key in self.keys:
            if len(key) != KEY_SIZE:
                raise ValueError(f"a manifest key is {len(key)} bytes, not {KEY_SIZE}")
        if len({key_id(k) for k in self.keys}) != len(self.keys):
            raise ValueError("the same manifest key is listed twice")

    @classmethod
    def generate(cls) -> ManifestKeys:
        return cls((secrets.token_bytes(KEY_SIZE),))

    @property
    def signing_id(self) -> str:
        return key_id(self.keys[0])

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(key_id(k) for k in self.keys)

    def sign(self, body: bytes) -> tuple[str, str]:
        """(key id, hex HMAC-SHA256) of ``body`` with the signing key."""
        return self.signing_id, _mac(self.keys[0], body)

    def holds(self, kid: str) -> bool:
        return kid in self.ids

    def check(self, kid: str, body: bytes, mac: str) -> bool:
        """Whether ``mac`` is the MAC of ``body`` by the accepted key named ``kid``."""
        for key in self.keys:
            if key_id(key) == kid:
                return hmac.compare_digest(_mac(key, body).encode(), mac.encode())
        return False


def _mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, MAC_DOMAIN + body, hashlib.sha256).hexdigest()
