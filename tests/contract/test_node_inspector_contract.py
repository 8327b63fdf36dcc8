"""Contract of ``NodeInspector``: ``ProcNodeInspector`` and ``FakeNodeInspector`` behave the
same (see core/ports/) on equivalent facts: a regular file, a directory, a process working in
that directory and writing to a file there, a pid that is free.

Implementations are listed in ``INSPECTORS`` (a new one is one line there)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from ckptd.adapters.procfs import ProcNodeInspector
from ckptd.core.ports import NodeInspector
from ckptd.domain import FileKind, ProcessFact
from ckptd.errors import ProcessNotFound
from ckptd.testing import FakeNodeInspector

DATA = b"model weights v1\n" * 64


@dataclass
class NodeHarness:
    node: NodeInspector
    tmp: Path
    """Holds ``data.bin`` (``DATA``) and ``work/`` (the process's directory) with ``log``."""
    proc: ProcessFact
    """A process working in ``work/`` with ``work/log`` open for writing."""
    gone: int
    ends: list[Callable[[], None]] = field(default_factory=list)


def _files(tmp: Path) -> None:
    (tmp / "data.bin").write_bytes(DATA)
    (tmp / "work").mkdir()


def _fact(pid: int) -> ProcessFact:
    return ProcessFact(pid, 1, "sleep", ("sleep", "60"), os.getuid(), os.getgid())


def _proc(tmp: Path) -> NodeHarness:
    _files(tmp)
    log = open(tmp / "work" / "log", "ab")  # noqa: SIM115 (closed with the harness)
    proc = subprocess.Popen(["sleep", "60"], cwd=tmp / "work", stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.DEVNULL)
    done = subprocess.Popen(["true"])
    done.wait(10)
    harness = NodeHarness(ProcNodeInspector(), tmp, _fact(proc.pid), done.pid)

    def end() -> None:
        proc.kill()
        proc.wait(10)
        log.close()

    harness.ends.append(end)
    return harness


def _fake(tmp: Path) -> NodeHarness:
    _files(tmp)
    node = FakeNodeInspector()
    node.add_file(str(tmp / "data.bin"), DATA, mtime_ns=(tmp / "data.bin").stat().st_mtime_ns)
    node.add_file(str(tmp / "work" / "log"))
    node.dirs.add(str(tmp / "work"))
    node.use(4242, str(tmp / "work"), FileKind.CWD)
    node.use(4242, str(tmp / "work" / "log"), FileKind.FILE, writable=True, append_only=True)
    node.gone.add(99999)
    return NodeHarness(node, tmp, _fact(4242), 99999)


INSPECTORS: dict[str, Callable[[Path], NodeHarness]] = {"procfs": _proc, "fake": _fake}


@pytest.fixture(params=sorted(INSPECTORS))
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NodeHarness]:
    harness = INSPECTORS[request.param](tmp_path)
    try:
        yield harness
    finally:
        for end in harness.ends:
            end()


def test_here_names_the_node_without_files(h: NodeHarness) -> None:
    here = h.node.here()
    assert here.arch and here.kernel and here.cpu_model
    assert here.files == () and here.criu_version == ""


def test_a_regular_file_with_and_without_its_hash(h: NodeHarness) -> None:
    path = str(h.tmp / "data.bin")
    need = h.node.file(path, FileKind.FILE, with_hash=True)
    assert need is not None
    assert (need.path, need.kind, need.size) == (path, FileKind.FILE, len(DATA))
    assert need.mtime_ns == (h.tmp / "data.bin").stat().st_mtime_ns
    assert need.hash == xxhash.xxh3_128_hexdigest(DATA)
    bare = h.node.file(path, FileKind.FILE, with_hash=False)
    assert bare is not None and bare.hash == ""


def test_missing_paths_are_none_directories_and_mounts_are_there(h: NodeHarness) -> None:
    assert h.node.file(str(h.tmp / "nope"), FileKind.FILE, with_hash=True) is None
    assert h.node.file(str(h.tmp / "nope"), FileKind.CWD, with_hash=False) is None
    cwd = h.node.file(str(h.tmp / "work"), FileKind.CWD, with_hash=False)
    assert cwd is not None and cwd.kind is FileKind.CWD
    assert h.node.file("/", FileKind.MOUNT, with_hash=False) is not None


def test_fingerprint_lists_what_the_tree_uses_with_its_mount(h: NodeHarness) -> None:
    fp = h.node.fingerprint([h.proc])
    by_path = {f.path: f for f in fp.files}
    work, log = str(h.tmp / "work"), str(h.tmp / "work" / "log")
    assert by_path[work].kind is FileKind.CWD
    assert by_path[log].kind is FileKind.FILE and by_path[log].writable
    assert by_path[log].hash == ""  # a file the tree writes is never hashed
    assert any(f.kind is FileKind.MOUNT for f in fp.files)
    assert len(by_path) == len(fp.files)  # one entry per path
    assert (fp.arch, fp.kernel) == (h.node.here().arch, h.node.here().kernel)


def test_a_gone_process_is_left_out_and_cannot_be_seen_by(h: NodeHarness) -> None:
    fp = h.node.fingerprint([_fact(h.gone)])
    assert not [f for f in fp.files if f.kind is not FileKind.MOUNT]
    with pytest.raises(ProcessNotFound):
        h.node.seen_by(h.gone)
