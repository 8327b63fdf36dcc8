"""``FakeNodeInspector``: a node's facts and files in memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import xxhash

from ckptd.domain import HASH_LIMIT, FileKind, FileNeed, NodeFingerprint, ProcessFact
from ckptd.errors import ProcessNotFound


@dataclass
class FakeFile:
    data: bytes = b""
    mtime_ns: int = 1_700_000_000_000_000_000
    size: int = -1
    """Size when it differs from ``len(data)`` (a big file without its bytes)."""

    @property
    def length(self) -> int:
        return len(self.data) if self.size < 0 else self.size


@dataclass
class FakeNodeInspector:
    """``NodeInspector`` over ``node`` (this node's facts, change them at will), ``files``
    (regular files by path), ``dirs`` and ``mounts``, and what each fake pid uses (``use``).

    ``calls`` counts ``fingerprint`` calls; ``events`` (shared with other fakes) gets
    ``node.fingerprint`` for each."""

    node: NodeFingerprint = field(
        default_factory=lambda: NodeFingerprint(
            arch="x86_64",
            cpu_model="Fake CPU @ 3.0GHz",
            cpu_flags=("avx2", "avx512f", "sse4_2"),
            kernel="6.8.0",
            libc="glibc 2.39",
        )
    )
    files: dict[str, FakeFile] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/"})
    mounts: set[str] = field(default_factory=lambda: {"/"})
    uses: dict[int, list[tuple[str, FileKind, bool]]] = field(default_factory=dict)
    append_only: set[str] = field(default_factory=set)
    events: list[str] | None = None
    calls: int = 0
    views: dict[int, FakeNodeInspector] = field(default_factory=dict)
    """What ``seen_by(pid)`` returns (a container's files); a pid not there sees this node's
    files, one in ``gone`` is a process that ended."""
    gone: set[int] = field(default_factory=set)
    missing_addresses: set[str] = field(default_factory=set)
    """IP addresses this node lacks (``has_address`` is False for them, True for others)."""

    # ---- set-up -----------------------------------------------------------------------------

    def add_file(self, path: str, data: bytes = b"", *, mtime_ns: int | None = None,
                 size: int = -1) -> None:
        f = FakeFile(data=data, size=size)
        if mtime_ns is not None:
            f.mtime_ns = mtime_ns
        self.files[path] = f

    def change_file(self, path: str, data: bytes | None = None, *,
                    mtime_ns: int | None = None) -> None:
        f = self.files[path]
        if data is not None:
            f.data = data
            f.size = -1
        f.mtime_ns = f.mtime_ns + 1_000_000_000 if mtime_ns is None else mtime_ns

    def use(self, pid: int, path: str, kind: FileKind = FileKind.FILE, *,
            writable: bool = False, append_only: bool = False) -> None:
        """Fake ``pid`` uses ``path`` (a file: ``add_file`` it too; a CWD: add it to
        ``dirs``); ``append_only``: written only through O_APPEND descriptors."""
        self.uses.setdefault(pid, []).append((path, kind, writable))
        if append_only:
            self.append_only.add(path)

    # ---- the port ---------------------------------------------------------------------------

    def here(self) -> NodeFingerprint:
        return replace(self.node, files=())

    def fingerprint(self, tree: Sequence[ProcessFact]) -> NodeFingerprint:
        self.calls += 1
        if self.events is not None:
            self.events.append("node.fingerprint")
        seen: dict[str, FileNeed] = {}
        for proc in tree:
            for path, kind, writable in self.uses.get(proc.pid, ()):
                if path in seen:
                    continue
                need = self.file(path, kind, not writable)
                if need is not None:
                    seen[path] = replace(need, writable=writable,
                                         append_only=writable and path in self.append_only)
        files = list(seen.values())
        points = sorted({self._mount_of(f.path) for f in files})
        files.extend(FileNeed(m, FileKind.MOUNT) for m in points)
        return replace(self.node, files=tuple(files))

    def file(self, path: str, kind: FileKind, with_hash: bool) -> FileNeed | None:
        if kind is FileKind.MOUNT:
            return FileNeed(path, kind) if path in self.mounts else None
        if kind is FileKind.CWD:
            return FileNeed(path, kind) if path in self.dirs else None
        f = self.files.get(path)
        if f is None:
            return None
        digest = ""
        if with_hash and f.length <= HASH_LIMIT:
            digest = xxhash.xxh3_128_hexdigest(f.data)
        return FileNeed(path, kind, size=f.length, mtime_ns=f.mtime_ns, hash=digest)

    def has_address(self, address: str) -> bool:
        return address.rpartition(":")[0].strip("[]") not in self.missing_addresses

    def seen_by(self, pid: int) -> FakeNodeInspector:
        if pid in self.gone:
            raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
        return self.views.get(pid, self)

    def _mount_of(self, path: str) -> str:
        best = "/"
        for m in self.mounts:
            if path.startswith(m.rstrip("/") + "/") and len(m) > len(best):
                best = m
        return best
