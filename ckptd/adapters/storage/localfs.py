"""``BlobStore`` on a local or NFS directory.

``put`` writes a temporary file and renames it into place (``if_absent``: hard-links it, which
fails if the name exists), so an object is whole or absent. Files are not fsynced one by one:
``flush`` fsyncs every file put since the last flush and the directories they are in — one
barrier before the manifest instead of one per object.

Modes: objects are created 0600 and directories 0700, whatever the umask; at construction
the root and every entry directly in it (the object directories, ``store.json``) lose any
group and other permission they had (a store directory that existed 0755, objects an older
ckptd wrote 0644 behind it), so nothing in the store is readable by other users, whatever
existed before. Deeper objects are not walked (a big store opens fast): the 0700 directories
above them keep them out of reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.adapters.storage.fsutil import fsync_dir
from ckptd.errors import BlobNotFound, StoreError

if TYPE_CHECKING:
    from typing_extensions import Buffer

IOV_MAX = 1024
log = logging.getLogger(__name__)


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = f"file://{root}"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._unsynced: set[Path] = set()
        self._dirty_dirs: set[Path] = set()
        self._tighten()

    def _tighten(self) -> None:
        """Drop group and other permissions of the root and of every entry directly in it
        (module docstring); a file system that refuses (NFS with root squashing) is logged."""
        try:
            entries = [self.root, *self.root.iterdir()]
        except OSError as exc:
            log.warning("cannot list store %s to check its modes: %s", self.root, exc)
            return
        for path in entries:
            try:
                st = path.lstat()
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                    continue
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
                log.warning("store: %s had mode %o, now %o", path, stat.S_IMODE(st.st_mode),
                            stat.S_IMODE(st.st_mode) & 0o700)
            except OSError as exc:
                log.warning("store: cannot restrict the mode of %s: %s", path, exc)

    def _mkdirs(self, path: Path) -> None:
        """``path`` and its missing parents under the root, each created 0700."""
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return
        except FileNotFoundError:
            if path == self.root or self.root not in path.parents:
                raise
            self._mkdirs(path.parent)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid object key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        return self.put_parts(key, [data], if_absent=if_absent)

    def put_parts(self, key: str, parts: Sequence[Buffer], *, if_absent: bool = False) -> bool:
        path = self._path(key)
        tmp = path.parent / f".tmp.{secrets.token_hex(6)}"
        try:
            self._mkdirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, parts)
            finally:
                os.close(fd)
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                finally:
                    tmp.unlink()
            else:
                os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(
                f"cannot write {path}: {exc}", hint="check the store's free space and permissions"
            ) from exc
        with self._lock:
            self._unsynced.add(path)
            self._dirty_dirs.update((path.parent, path.parent.parent))
        return True

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                stop = size if end is None else min(end, size)
                if start >= stop:
                    return b""
                return os.pread(fh.fileno(), stop - start, start)
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise BlobNotFound(f"object {key} not found in {self.location}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def size(self, key: str) -> int:
        try:
            st = self._path(key).stat()
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(key)
            return st.st_size
        except FileNotFoundError as exc:
            raise BlobNotFound(f"object {key} not found in {self.location}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        if prefix:
            self._path(prefix.rstrip("/"))  # refuses absolute and '..' prefixes
        top = self.root / prefix.rpartition("/")[0]
        if not top.is_dir():
            return
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name.startswith(".tmp."):
                    continue
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        yield key, path.stat().st_mtime

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            with self._lock:
                self._dirty_dirs.add(path.parent)

    def flush(self) -> None:
        """Every file put since the last flush, and every directory an entry was added to or
        removed from, fsynced before this returns (a failure raises; what was taken for this
        flush is not retried by the next one, whose caller fails too: nothing is listed).

        The fsyncs run side by side (:data:`FLUSH_THREADS`), files and directories together:
        a small checkpoint puts a dozen objects in a dozen directories, and one at a time their
        fsyncs cost each a journal commit (~1 ms on a virtio disk, issue 25's small job);
        issued together the file system commits them in one or two. No order is needed among
        them: a file's data and its name are both durable when flush returns, and nothing
        that depends on them is written before."""
        with self._lock:
            files, self._unsynced = self._unsynced, set()
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        work: list[tuple[Callable[[Path], None], Path]] = [(_fsync_file, f) for f in files]
        work += [(_fsync_dir_if_any, d) for d in dirs if d.is_relative_to(self.root)]
        try:
            _fsync_all(work)
        except OSError as exc:
            raise StoreError(f"cannot make the store durable: {exc}") from exc

    def remove_temporaries(self) -> int:
        """Delete ``.tmp.*`` files a crash left behind. Returns how many."""
        count = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".tmp."):
                    with contextlib.suppress(FileNotFoundError):
                        (Path(dirpath) / name).unlink()
                        count += 1
        return count


FLUSH_THREADS = 16
"""fsyncs issued at once by :meth:`LocalBlobStore.flush` (they wait on the disk, not a CPU)."""
_flush_pool: list[ThreadPoolExecutor] = []
"""The one pool of fsync threads, made on first use (a daemon that never flushes has none)."""
_flush_pool_lock = threading.Lock()


def _fsync_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # deleted since (GC, a removed lease)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir_if_any(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # removed since
        fsync_dir(path)


def _fsync_all(work: list[tuple[Callable[[Path], None], Path]]) -> None:
    """Every ``fsync(path)`` of ``work``, side by side; returns once all are done, raises the
    first failure (after all have ended)."""
    if len(work) <= 1:
        for fsync, path in work:
            fsync(path)
        return
    with _flush_pool_lock:
        if not _flush_pool:
            _flush_pool.append(ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="fsync"))
        pool = _flush_pool[0]
    futures = [pool.submit(fsync, path) for fsync, path in work]
    wait(futures)
    for future in futures:
        future.result()


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """Write every part, in order, with as few ``writev`` calls as the kernel allows (a short
    write is resumed where it stopped)."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:IOV_MAX]
        done = os.writev(fd, batch)
        while done and views:
            if done >= views[0].nbytes:
                done -= views.pop(0).nbytes
            else:
                views[0] = views[0][done:]
                done = 0
