"""The node's manifest keys, in a file outside the store (docs/adr/0014-authenticated-manifests.md).

Format: one key a line, 64 hex digits; blank lines and ``#`` comments ignored. The first key
signs the manifests this node writes; every key listed is accepted when reading (rotation).
Every node sharing a store holds the same file (copied by the operator, or a secret mounted
from a secrets manager).

Invariants: the file is created once, atomically (hard link of a complete temporary: two
daemons starting at once end up with the same key), with mode 0600 in a directory created
0700; an existing file readable or writable by group or others is tightened to 0600 (and
logged) before its keys are used; a key file that is not a regular file owned by this
process's user, or that holds no valid key, is refused (``ValueError``: the daemon does not
start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

from ckptd.core.store.keys import KEY_SIZE, ManifestKeys

log = logging.getLogger(__name__)

HEADER = (
    "# ckptd manifest keys (docs/adr/0014-authenticated-manifests.md): one key a line, the\n"
    "# first signs, all are accepted. Give every node sharing the store this same file.\n"
)


def load_or_create(path: Path) -> tuple[ManifestKeys, bool]:
    """The keys in ``path``, created (one fresh key) if it does not exist. Returns (keys,
    whether this call created the file)."""
    try:
        return _load_or_create(path)
    except OSError as exc:
        raise ValueError(f"manifest key file {path}: {exc.strerror or exc}") from exc


def _load_or_create(path: Path) -> tuple[ManifestKeys, bool]:
    created = False
    if not path.exists():
        created = _create(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"manifest key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"manifest key file {path} is owned by uid {st.st_uid}, not "
                             f"{os.geteuid()}: refused")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning("manifest key file %s had mode %o: tightened to 600",
                        path, stat.S_IMODE(st.st_mode))
        text = os.read(fd, 1 << 20).decode("ascii", "replace")
    finally:
        os.close(fd)
    return parse(text, path), created


def parse(text: str, path: Path) -> ManifestKeys:
    keys = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            key = b""
        if len(key) != KEY_SIZE:
            raise ValueError(f"manifest key file {path}, line {no}: not {KEY_SIZE * 2} hex "
                             "digits")
        keys.append(key)
    if not keys:
        raise ValueError(f"manifest key file {path} holds no key")
    return ManifestKeys(tuple(keys))


def _create(path: Path) -> bool:
    """Write a fresh key file at ``path`` unless one appears meanwhile. Whether it wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (HEADER + secrets.token_hex(KEY_SIZE) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True
