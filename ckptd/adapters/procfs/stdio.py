"""Replacements for stdio whose other end was outside the checkpointed tree.

- a pipe the tree wrote to (a launcher's stdout): the restore's output file (append);
- a pipe the tree read from: /dev/null (reads see end of file);
- a terminal: a new pseudo-terminal; a small relay process (``python -m
  ckptd.adapters.procfs.ptyrelay``) copies what the tree writes there to the output file and
  exits when the tree closes it. The relay is not tied to the daemon: restarting the daemon
  never cuts a restored job's terminal.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptd.adapters.procfs.safefs import RESOLVE_NO_MAGICLINKS, openat2
from ckptd.core.ports import InheritFd
from ckptd.domain import StdioFact, StdioKind
from ckptd.errors import InvalidTarget, PermissionDenied, ProcessNotFound, StoreError

OPEN_TIMEOUT_S = 10.0


class LocalStdioProvider:
    """Opens the restore's output file for the restored tree.

    A path the caller chose is opened as the job's owner (``setfsuid``), never creating a
    directory, non-blocking (a FIFO without a reader is refused at once, ENXIO) and in a
    thread of its own bounded by ``open_timeout_s`` (a hung file system fails the request,
    not the worker). It must be a regular file, a character device or a FIFO with a reader;
    O_NONBLOCK is cleared once open, so the restored tree sees an ordinary blocking file."""

    def __init__(self, open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        self._open_timeout_s = open_timeout_s

    @contextlib.contextmanager
    def replacements(
        self, stdio: Sequence[StdioFact], output_path: Path, owner: tuple[int, int] = (0, 0),
        chosen_by_caller: bool = False,
    ) -> Iterator[tuple[InheritFd, ...]]:
        ours: list[int] = []
        out: dict[str, InheritFd] = {}
        output_fd: int | None = None

        def output() -> int:
            nonlocal output_fd
            if output_fd is None:
                if chosen_by_caller:
                    output_fd = open_chosen(output_path, owner, self._open_timeout_s)
                else:
                    try:
                        output_path.parent.mkdir(parents=True, exist_ok=True)
                        output_fd = _open_bounded(output_path, None, self._open_timeout_s)
                        if owner[0] != 0:
                            os.fchown(output_fd, *owner)
                    except OSError as exc:
                        raise StoreError(
                            f"cannot open the restore's output file {output_path}: {exc}",
                            hint="choose an --output path",
                        ) from exc
                ours.append(output_fd)
            return output_fd

        try:
            for fact in stdio:
                if not fact.external_key or fact.external_key in out:
                    continue
                if fact.kind is StdioKind.TTY:
                    fd = _pty_to_file(output(), ours)
                elif fact.writable and _holds_data(output()):
                    # CRIU reopens an inherited file with the image's flags (O_APPEND
                    # dropped, offset 0): what the file held would be overwritten. A pipe
                    # (what the job had) relayed to the file appends instead.
                    fd = _pipe_to_file(output(), ours)
                elif fact.writable:
                    # CRIU takes over (and closes) each inherited fd: one fd per key.
                    fd = os.dup(output())
                    ours.append(fd)
                else:
                    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                    ours.append(fd)
                out[fact.external_key] = InheritFd(fact.external_key, fd)
            yield tuple(out.values())
        finally:
            for fd in ours:
                with contextlib.suppress(OSError):
                    os.close(fd)


    @contextlib.contextmanager
    def from_process(
        self, stdio: Sequence[StdioFact], pid: int
    ) -> Iterator[tuple[InheritFd, ...]]:
        ours: list[int] = []
        out: dict[str, InheritFd] = {}
        try:
            for fact in stdio:
                if not fact.external_key or fact.external_key in out:
                    continue
                if fact.fd in (0, 1, 2):
                    source, writable = fact.fd, fact.fd != 0
                elif fact.writable:
                    source, writable = 1, True
                else:
                    source, writable = -1, False
                path = f"/proc/{pid}/fd/{source}" if source >= 0 else os.devnull
                try:
                    fd = os.open(path, (os.O_WRONLY if writable else os.O_RDONLY)
                                 | os.O_CLOEXEC)
                except OSError as exc:
                    raise ProcessNotFound(
                        f"cannot reopen descriptor {source} of process {pid} for the restored "
                        f"tree's fd {fact.fd}: {exc.strerror}", pid=pid) from exc
                ours.append(fd)
                out[fact.external_key] = InheritFd(fact.external_key, fd)
            yield tuple(out.values())
        finally:
            for fd in ours:
                with contextlib.suppress(OSError):
                    os.close(fd)


AT_FDCWD = -100
_OUTPUT_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
                 | os.O_NOCTTY)


def open_chosen(path: Path, owner: tuple[int, int], timeout_s: float) -> int:
    """The output file a caller chose, opened as ``owner`` (root's rights only for root's
    jobs); InvalidTarget / PermissionDenied naming the path and the cause otherwise."""
    try:
        fd = _open_bounded(path, owner if owner[0] != 0 else None, timeout_s)
    except TimeoutError as exc:
        raise InvalidTarget(
            f"--output {path}: opening it took longer than {timeout_s:g}s (a hung or slow "
            "file system?)", hint="choose a path on a local file system") from exc
    except OSError as exc:
        why = {
            errno.ENOENT: f"its directory {path.parent} does not exist (ckptd creates no "
                          "directories for a caller)",
            errno.ENXIO: "it is a FIFO with no reader (or a socket)",
            errno.EISDIR: "it is a directory",
            errno.ENOTDIR: "a component of its directory is not a directory",
            errno.ELOOP: "it is reached through a /proc magic link (or too many symbolic "
                         "links)",
            errno.EROFS: "its file system is read-only",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise PermissionDenied(
                f"--output {path}: the job's owner (uid {owner[0]}) may not write there",
                hint="choose a path its owner may write") from exc
        raise InvalidTarget(f"--output {path}: {why}",
                            hint="choose another --output path") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            raise InvalidTarget(f"--output {path}: not a regular file",
                                hint="choose a file's path")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_output(path: Path) -> int:
    """``path`` opened for appending, 0600 when created; a /proc magic link (``/proc/self/
    fd/1`` would be the daemon's own log) is refused (ELOOP), never followed."""
    return openat2(AT_FDCWD, str(path), _OUTPUT_FLAGS, 0o600, RESOLVE_NO_MAGICLINKS)


def _open_bounded(path: Path, owner: tuple[int, int] | None, timeout_s: float) -> int:
    """``os.open(path, _OUTPUT_FLAGS)`` (as ``owner`` when given) in a thread of its own:
    TimeoutError after ``timeout_s`` (the thread, stuck in the kernel, closes what it opens
    late); the open's OSError otherwise."""
    done = threading.Event()
    lock = threading.Lock()
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            if owner is not None:
                with _as_user(*owner):  # the user's rights, never root's
                    fd = _open_output(path)
            else:
                fd = _open_output(path)
        except OSError as exc:
            got["error"] = exc
        else:
            with lock:
                if got.get("abandoned"):
                    os.close(fd)
                else:
                    got["fd"] = fd
        done.set()

    threading.Thread(target=run, name="open-output", daemon=True).start()
    if not done.wait(timeout_s):
        with lock:
            if "fd" not in got:
                got["abandoned"] = True
                raise TimeoutError(f"open {path}")
    if "error" in got:
        raise got["error"]
    fd_: int = got["fd"]
    if owner is None:  # not the caller's path: undo O_NONBLOCK as well
        fcntl.fcntl(fd_, fcntl.F_SETFL, fcntl.fcntl(fd_, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd_


_LIBC = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _as_user(uid: int, gid: int) -> Iterator[None]:
    """This thread's file-system identity becomes (uid, gid) for the block: files are opened
    and created with that user's rights. setfsuid is per thread (the other threads of the
    daemon keep root's), and glibc does not broadcast it."""
    old_gid = _LIBC.setfsgid(gid)
    old_uid = _LIBC.setfsuid(uid)
    try:
        yield
    finally:
        _LIBC.setfsuid(old_uid)
        _LIBC.setfsgid(old_gid)


def _holds_data(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


def _pipe_to_file(output_fd: int, ours: list[int]) -> int:
    """A new pipe whose write end is returned; a detached relay appends what it reads to
    output_fd (opened O_APPEND) until every writer closed it."""
    read_end, write_end = os.pipe()
    ours.extend((read_end, write_end))
    _relay(read_end, output_fd)
    return write_end


def _relay(source: int, output_fd: int) -> None:
    relay = subprocess.Popen(
        [sys.executable, "-m", "ckptd.adapters.procfs.ptyrelay", str(source), str(output_fd)],
        pass_fds=(source, output_fd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    threading.Thread(target=relay.wait, name="relay-reaper", daemon=True).start()


def _pty_to_file(output_fd: int, ours: list[int]) -> int:
    """A new pty whose slave is returned; a detached relay copies its master to output_fd."""
    master, slave = os.openpty()
    ours.extend((master, slave))
    _relay(master, output_fd)
    return slave
