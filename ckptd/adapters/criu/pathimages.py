"""What CRIU resolves by path at a restore, read from its images (``CriuPaths``).

CRIU reopens every file a restored task holds by the path its images name — regular files
open or mapped, executables, working and root directories (``fs.img`` names them as file
entries), named FIFOs (a FIFO entry points at a file entry) — and creates some by path: the
ghost file of a deleted one (``<path>.cr.<remap id>.ghost``, or the directory itself), the
file of a bound unix socket. All of them are file entries of ``files.img`` (``reg`` and
``usk``), with ``remap-fpath.img`` saying which are deleted (ghost, link-remap, a dead
process's /proc). A deleted file still linked elsewhere is linked back by CRIU's dump as
``link_remap.N``: ``relinks`` pairs it with the deleted name and with the name the object was
still linked as (``RELINKS_IMAGE``, ckptd's own, written at the dump). Decoded from the
protobuf wire format like ``images.tcp_connections_in`` (only the fields named below), so
that ckptd needs neither ``crit`` nor CRIU's schemas.

Invariant: an image that cannot be read yields the paths read so far plus ``unreadable``
set; the restore then refuses (ckptd does not let CRIU resolve paths it has not checked).
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptd.adapters.criu.images import IMG_COMMON_MAGIC, proto_fields
from ckptd.core.ports import CriuCreates, CriuPaths, ImageSource
from ckptd.core.ports.criu import RELINKS_IMAGE, CriuRelink, decode_relinks

_FD_REG = 1
_FD_UNIXSK = 5
_REMAP_LINKED, _REMAP_GHOST, _REMAP_PROCFS = 0, 1, 2
_PSEUDO = ("/proc/", "/sys/")
"""Paths in the restored tree's own pseudo file systems: nobody can swap a directory there."""


@dataclass(frozen=True)
class ImagePaths:
    paths: CriuPaths
    unreadable: str = ""
    """Which image could not be read ("" when both were)."""


def entries(raw: bytes) -> Iterator[bytes]:
    """The messages of a CRIU image (after its two magic numbers). Raises ValueError for
    an image cut short or of another kind."""
    if len(raw) < 8 or struct.unpack_from("<I", raw, 0)[0] != IMG_COMMON_MAGIC:
        raise ValueError("not a CRIU image")
    offset = 8
    while offset + 4 <= len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise ValueError("entry cut short")
        yield raw[offset : offset + size]
        offset += size
    if offset != len(raw):
        raise ValueError("trailing bytes")


def _remaps(raw: bytes | None) -> dict[int, tuple[int, int]]:
    """orig_id -> (remap type, remap id)."""
    found: dict[int, tuple[int, int]] = {}
    if raw is None:
        return found
    for entry in entries(raw):
        fields = {n: v for n, v in proto_fields(entry) if isinstance(v, int)}
        found[fields.get(1, 0)] = (fields.get(3, _REMAP_LINKED), fields.get(2, 0))
    return found


def _absolute(name: str) -> str:
    return name if name.startswith("/") else "/" + name


def criu_paths_in(files_raw: bytes | None, remaps_raw: bytes | None,
                  relinks_raw: bytes | None = None) -> ImagePaths:
    """The paths of ``files.img`` (``files_raw``; None: no such image, no file) given the
    deleted files of ``remap-fpath.img`` (``remaps_raw``; None: none was deleted) and the
    names link-remap files were linked as (``relinks_raw``, ``RELINKS_IMAGE``; None: not
    recorded)."""
    opened: dict[str, None] = {}
    created: dict[CriuCreates, None] = {}
    try:
        remaps = _remaps(remaps_raw)
    except (ValueError, IndexError, struct.error):
        return ImagePaths(CriuPaths(), "remap-fpath.img")
    try:
        linked_as = decode_relinks(relinks_raw) if relinks_raw is not None else {}
    except ValueError:
        return ImagePaths(CriuPaths(), RELINKS_IMAGE)
    if files_raw is None:
        return ImagePaths(CriuPaths())
    regs: dict[int, tuple[str, int]] = {}
    try:
        for entry in entries(files_raw):
            fields = dict(proto_fields(entry))
            kind = fields.get(1)
            if kind == _FD_REG and isinstance(fields.get(3), bytes):
                found = _regular(fields[3])  # type: ignore[arg-type]
                if found is not None:
                    regs[found[0]] = found[1:]
            elif kind == _FD_UNIXSK and isinstance(fields.get(16), bytes):
                _unix(fields[16], created)  # type: ignore[arg-type]
    except (ValueError, IndexError, struct.error, UnicodeDecodeError):
        return ImagePaths(CriuPaths(tuple(opened), tuple(created)), "files.img")
    linked = {remap_id for kind, remap_id in remaps.values() if kind == _REMAP_LINKED}
    for fid, (path, mode) in regs.items():
        remap = remaps.get(fid)
        if remap is None:
            opened[path] = None
            if fid in linked:  # CRIU opens it, then removes it by path
                created[CriuCreates(path, "link-remap file")] = None
        elif remap[0] == _REMAP_GHOST:  # CRIU makes the deleted file again, then removes it
            if stat.S_ISDIR(mode):
                created[CriuCreates(path, "ghost directory")] = None
            else:
                created[CriuCreates(f"{path}.cr.{remap[1]:x}.ghost", "ghost file")] = None
        # _REMAP_LINKED: CRIU opens the link-remap file, a file entry of its own (above);
        # _REMAP_PROCFS: a dead process's /proc entry, made by CRIU in the tree's own /proc
    relinks = tuple(
        CriuRelink(regs[remap_id][0], regs[fid][0], linked_as.get(regs[remap_id][0], ""))
        for fid, (kind, remap_id) in sorted(remaps.items())
        if kind == _REMAP_LINKED and fid in regs and remap_id in regs)
    return ImagePaths(CriuPaths(tuple(opened), tuple(created), relinks))


def _regular(reg: bytes) -> tuple[int, str, int] | None:
    """(id, absolute path, mode) of a file entry CRIU resolves by path; None for one it does
    not (no path, an external file handed to CRIU, the tree's own pseudo file systems)."""
    ints: dict[int, int] = {}
    name = ""
    for number, value in proto_fields(reg):
        if number == 6 and isinstance(value, bytes):
            name = value.decode()
        elif isinstance(value, int):
            ints[number] = value
    if not name or ints.get(9):
        return None
    path = _absolute(name)
    if path.startswith(_PSEUDO):
        return None
    return ints.get(1, 0), path, ints.get(10, 0)


def _unix(usk: bytes, created: dict[CriuCreates, None]) -> None:
    name = b""
    name_dir = ""
    owner = -1
    for number, value in proto_fields(usk):
        if number == 11 and isinstance(value, bytes):
            name = value
        elif number == 14 and isinstance(value, bytes):
            name_dir = value.decode()
        elif number == 13 and isinstance(value, bytes):  # file_perms: mode 1, uid 2, gid 3
            owner = next((v for n, v in proto_fields(value) if n == 2 and isinstance(v, int)),
                         -1)
    if not name or name[0] == 0:  # unbound, or abstract: nothing on a file system
        return
    text = name.rstrip(b"\0").decode()
    if not text.startswith("/"):
        text = f"{name_dir.rstrip('/')}/{text}" if name_dir else text
    created[CriuCreates(_absolute(text), "unix socket", owner)] = None


def read_restore_paths(images_dir: Path, images: ImageSource | None) -> ImagePaths:
    """``criu_paths_in`` of a restore's images: in ``images_dir``, or streamed from
    ``images`` (its source is read, and verified, once more: the two images are small)."""

    def read(name: str) -> bytes | None:
        if images is None:
            try:
                return (images_dir / name).read_bytes()
            except FileNotFoundError:
                return None
        if not images.exists(name):
            return None
        return b"".join(bytes(chunk) for chunk in images.chunks(name))

    try:
        remaps = read("remap-fpath.img")
    except (OSError, KeyError) as exc:
        return ImagePaths(CriuPaths(), f"remap-fpath.img ({exc})")
    try:
        files = read("files.img")
    except (OSError, KeyError) as exc:
        return ImagePaths(CriuPaths(), f"files.img ({exc})")
    try:
        relinks = read(RELINKS_IMAGE) if remaps is not None else None
    except (OSError, KeyError) as exc:
        return ImagePaths(CriuPaths(), f"{RELINKS_IMAGE} ({exc})")
    return criu_paths_in(files, remaps, relinks)
