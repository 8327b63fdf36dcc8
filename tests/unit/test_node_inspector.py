"""The real NodeInspector: its /proc parsers, and a fingerprint of this test process."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from ckptd.adapters.procfs import ProcFsTable, ProcNodeInspector
from ckptd.adapters.procfs.node import parse_cpuinfo, parse_maps, parse_mount_points
from ckptd.domain import FileKind

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1234  /usr/bin/python3.11
7f00aa000000-7f00aa100000 r-xp 00000000 08:01 99    /usr/lib/x86_64-linux-gnu/libc.so.6
7f00ab000000-7f00ab001000 rw-s 00000000 00:05 7     /dev/zero (deleted)
7f00ac000000-7f00ac001000 r--s 00000000 08:01 55    /tmp/old.bin (deleted)
7f00ad000000-7f00ad001000 rw-p 00000000 00:00 0     [heap]
7f00ae000000-7f00ae001000 rw-s 00000000 00:01 3     /memfd:x (deleted)
7f00af000000-7f00af001000 rw-p 00000000 00:00 0
"""


def test_parse_cpuinfo_x86_and_arm() -> None:
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: sse avx2 avx512f\n\n" \
          "processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: sse\n"
    assert parse_cpuinfo(x86) == ("AMD EPYC 9654", ("avx2", "avx512f", "sse"))
    arm = "processor\t: 0\nFeatures\t: fp asimd\nCPU part\t: 0xd4f\n"
    assert parse_cpuinfo(arm) == ("CPU part 0xd4f", ("asimd", "fp"))


def test_parse_maps_keeps_real_files_only() -> None:
    assert parse_maps(MAPS + "7f00b0000000-7f00b0001000 rw-s 00000000 08:01 8  /d/m.bin\n") == [
        ("/usr/bin/python3.11", False),
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", False),
        ("/d/m.bin", True),
    ]


def test_parse_mount_points_decodes_escapes() -> None:
    text = (
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:35 / /mnt/my\\040data rw - tmpfs tmpfs rw\n"
    )
    assert parse_mount_points(text) == ["/", "/mnt/my data"]


def test_fingerprint_of_this_process(tmp_path: Path) -> None:
    small = tmp_path / "small.json"
    small.write_bytes(b'{"a": 1}' * 10)
    written = tmp_path / "out.log"
    shared = tmp_path / "shared.bin"
    shared.write_bytes(bytes(4096))
    inspector = ProcNodeInspector()
    with small.open("rb") as f, written.open("ab") as w, shared.open("r+b") as s, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), mmap.mmap(s.fileno(), 0):
        assert w.writable()
        fp = inspector.fingerprint(ProcFsTable().tree(os.getpid()))
    assert fp.arch == os.uname().machine and fp.kernel == os.uname().release
    by_path = {f.path: f for f in fp.files}
    assert len(by_path) == len(fp.files)
    assert by_path[os.path.realpath("/proc/self/exe")].kind is FileKind.EXE
    need = by_path[str(small)]
    assert need.kind is FileKind.MAP and need.size == 80 and len(need.hash) == 32
    assert by_path[str(written)].writable and by_path[str(written)].hash == ""
    assert by_path[str(shared)].kind is FileKind.MAP and by_path[str(shared)].writable
    assert by_path[os.getcwd()].kind is FileKind.CWD
    assert "/" in {f.path for f in fp.files if f.kind is FileKind.MOUNT}
    # as this node sees them now
    assert inspector.file(str(small), FileKind.MAP, True) == need
    small.write_bytes(b"changed")
    assert inspector.file(str(small), FileKind.MAP, True) != need
    assert inspector.file(str(tmp_path / "nope"), FileKind.FILE, True) is None
    assert inspector.file(str(tmp_path), FileKind.CWD, False) is not None
    assert inspector.file("/", FileKind.MOUNT, False) is not None
    assert inspector.file(str(tmp_path / "nope"), FileKind.MOUNT, False) is None
