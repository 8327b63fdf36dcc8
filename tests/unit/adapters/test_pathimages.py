"""Issue 33.1: the paths CRIU resolves at a restore, read from files.img and remap-fpath.img
(encoded here as CRIU writes them: protobuf entries, each behind its 32-bit length)."""

from __future__ import annotations

import struct

from ckptd.adapters.criu.images import IMG_COMMON_MAGIC
from ckptd.adapters.criu.pathimages import criu_paths_in
from ckptd.core.ports import CriuCreates


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _image(*entries: bytes) -> bytes:
    return struct.pack("<II", IMG_COMMON_MAGIC, 0x56303138) + b"".join(
        struct.pack("<I", len(e)) + e for e in entries)


def _reg(fid: int, name: str, *, mode: int = 0o100644, ext: bool = False) -> bytes:
    reg = _int(1, fid) + _bytes(6, name.encode()) + _int(10, mode) + (_int(9, 1) if ext else b"")
    return _int(1, 1) + _int(2, fid) + _bytes(3, reg)


def _unix(name: bytes, name_dir: str = "", owner: int = -1) -> bytes:
    usk = _int(1, 9) + _bytes(11, name) + (_bytes(14, name_dir.encode()) if name_dir else b"")
    if owner >= 0:
        usk += _bytes(13, _int(1, 0o140755) + _int(2, owner) + _int(3, owner))
    return _int(1, 5) + _int(2, 9) + _bytes(16, usk)


def _remap(orig: int, remap: int, kind: int) -> bytes:
    return _int(1, orig) + _int(2, remap) + _int(3, kind)


def test_every_kind_of_path() -> None:
    files = _image(
        _reg(1, "/home/u/data/log"),            # an open file
        _reg(2, "/"),                            # root directory
        _reg(3, "/home/u/data", mode=0o40755),   # cwd
        _reg(4, "/home/u/tmp/gone"),             # deleted: a ghost
        _reg(5, "/home/u/tmp/gonedir", mode=0o40700),  # a deleted directory
        _reg(6, "/dev/shm/sem.mp-x"),            # deleted, still linked: link-remap
        _reg(7, "/dev/shm/link_remap.7"),        # ... which CRIU opens
        _reg(8, "/proc/1234/status"),            # the tree's own /proc
        _reg(9, "/ext/file", ext=True),          # external: handed to CRIU
        _unix(b"/run/u/sock"), _unix(b"rel.sock", "/home/u/data", owner=1000), _unix(b"\0abstract"),
    )
    remaps = _image(_remap(4, 0x1f, 1), _remap(5, 0x20, 1), _remap(6, 7, 0))
    found = criu_paths_in(files, remaps)
    assert found.unreadable == ""
    assert found.paths.opened == ("/home/u/data/log", "/", "/home/u/data",
                                  "/dev/shm/link_remap.7")
    assert found.paths.created == (
        CriuCreates("/run/u/sock", "unix socket"),
        CriuCreates("/home/u/data/rel.sock", "unix socket", 1000),
        CriuCreates("/home/u/tmp/gone.cr.1f.ghost", "ghost file"),
        CriuCreates("/home/u/tmp/gonedir", "ghost directory"),
        CriuCreates("/dev/shm/link_remap.7", "link-remap file"),
    )


def test_no_files_image_no_path_and_a_damaged_one_is_said() -> None:
    assert criu_paths_in(None, None).paths.opened == ()
    cut = _image(_reg(1, "/a/b"))[:-3]
    assert criu_paths_in(cut, None).unreadable == "files.img"
    assert criu_paths_in(_image(_reg(1, "/a/b")), b"junk").unreadable == "remap-fpath.img"
