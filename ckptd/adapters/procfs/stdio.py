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
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptd.core.ports import InheritFd
from ckptd.domain import StdioFact, StdioKind
from ckptd.errors import ProcessNotFound, StoreError


class LocalStdioProvider:
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
                try:
                    if chosen_by_caller and owner[0] != 0:
                        with _as_user(*owner):  # the user's rights, never root's
                            output_fd = _open_output(output_path)
                    else:
                        output_fd = _open_output(output_path)
                        if owner[0] != 0:
                            os.fchown(output_fd, *owner)
                except OSError as exc:
                    raise StoreError(
                        f"cannot open the restore's output file {output_path}: {exc}",
                        hint="choose another --output path",
                    ) from exc
                ours.append(output_fd)
            return output_fd

        try:
            for fact in stdio:
                if not fact.external_key or fact.external_key in out:
                    continue
                if fact.kind is StdioKind.TTY:
                    fd = _pty_to_file(output(), ours)
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


def _open_output(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)


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


def _pty_to_file(output_fd: int, ours: list[int]) -> int:
    """A new pty whose slave is returned; a detached relay copies its master to output_fd."""
    master, slave = os.openpty()
    ours.extend((master, slave))
    relay = subprocess.Popen(
        [sys.executable, "-m", "ckptd.adapters.procfs.ptyrelay", str(master), str(output_fd)],
        pass_fds=(master, output_fd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    threading.Thread(target=relay.wait, name="ptyrelay-reaper", daemon=True).start()
    return slave
