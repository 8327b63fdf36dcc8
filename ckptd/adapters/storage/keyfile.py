"""The node's manifest keys, in a file outside the store (docs/adr/0014-authenticated-manifests.md).

Format: one key a line, 64 hex digits; blank lines and ``#`` comments ignored. The first key
signs the manifests this node writes; every key listed is accepted when reading (rotation).
Every node sharing a store holds the same file (copied by the operator, or a secret mounted
from a secrets manager).

Invariants: the file is only ever opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
``fstat`` before it is read, so nothing here blocks (a FIFO) or follows a link; it is used only
if it is a regular file, owned by this process's user (root, for the daemon), with no
permission for group or others, holding at least one valid key — anything else is refused
(``ValueError``, one line: what is wrong and what to do; the daemon does not start), never
repaired. ``load`` never creates anything; ``create`` writes a complete temporary (``O_EXCL``,
mode 0600) and hard-links it into place, so the file appears whole and at most once (two
daemons starting at once end up with the same key), in a directory created 0700. Whether a
key may be created at all (a store whose manifests were signed by another key must not get a
new one) is the caller's decision.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from ckptd.core.store.keys import KEY_SIZE, ManifestKeys

HEADER = (
    "# ckptd manifest keys (docs/adr/0014-authenticated-manifests.md): one key a line, the\n"
    "# first signs, all are accepted. Give every node sharing the store this same file.\n"
)
MAX_SIZE = 1 << 20
"""A key file is small: more than this is not one."""


def load(path: Path) -> ManifestKeys | None:
    """The keys in ``path``; None when nothing is there (not even a dangling link)."""
    try:
        return _load(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"manifest key file {path}: {exc.strerror or exc}") from exc


def create(path: Path) -> tuple[ManifestKeys, bool]:
    """Create ``path`` with one fresh key unless it appears meanwhile, then load it (checked
    like any key file). Returns (keys, whether this call created the file)."""
    try:
        created = _create(path)
    except OSError as exc:
        raise ValueError(f"manifest key file {path}: cannot create it: "
                         f"{exc.strerror or exc}") from exc
    keys = load(path)
    if keys is None:  # removed between its creation and now
        raise ValueError(f"manifest key file {path} vanished as it was created; start again")
    return keys, created


def load_or_create(path: Path) -> tuple[ManifestKeys, bool]:
    """The keys in ``path``, created (one fresh key) if nothing is there. Returns (keys,
    whether this call created the file). For tools and tests: the daemon decides first
    whether its store allows a new key (``daemon.wiring.manifest_keys``)."""
    keys = load(path)
    return (keys, False) if keys is not None else create(path)


def _load(path: Path) -> ManifestKeys:
    before = os.lstat(path)  # never open a device, a FIFO or a link at all
    _check(path, before)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # became a link since lstat
            raise ValueError(_refusal(path, "is a symbolic link")) from exc
        raise
    try:
        st = os.fstat(fd)  # what is actually open decides
        _check(path, st)
        data = os.read(fd, MAX_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SIZE:
        raise ValueError(_refusal(path, f"is larger than {MAX_SIZE} bytes: not a key file"))
    return parse(data.decode("ascii", "replace"), path)


def _check(path: Path, st: os.stat_result) -> None:
    """Refuse (ValueError, one line) a key file that is not safe to use (module docstring)."""
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(_refusal(path, "is a symbolic link"))
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(_refusal(path, f"is not a regular file (it is {_kind(st.st_mode)})"))
    owner = os.geteuid()
    if st.st_uid != owner:
        raise ValueError(
            f"manifest key file {path} is owned by uid {st.st_uid}, not by uid {owner} "
            f"({'root, ' if owner == 0 else ''}the daemon's user): refused; "
            f"chown {owner} {path}, or point manifest_keys (--manifest-keys) at the right file"
        )
    if st.st_mode & 0o077:
        raise ValueError(
            f"manifest key file {path} has mode {stat.S_IMODE(st.st_mode):o}: group or others "
            f"may use it, refused; chmod 600 {path} (and, if others could read it, rotate the "
            "key: README, 'What the store protects against tampering')"
        )


def _refusal(path: Path, what: str) -> str:
    return (f"manifest key file {path} {what}: refused; point manifest_keys (--manifest-keys) "
            "at the key file itself, a regular file of mode 600")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"of type {stat.S_IFMT(mode):o}"


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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (HEADER + secrets.token_hex(KEY_SIZE) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # exclusive, like O_EXCL, and the file appears whole
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
