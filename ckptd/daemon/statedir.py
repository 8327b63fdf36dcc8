"""The daemon's state directory (journal, work, logs, lock), checked before anything is written.

``open_state_dir`` creates it 0700 when missing; an existing one is opened without following
a symlink (``O_DIRECTORY | O_NOFOLLOW``), refused unless the daemon's user owns it, and
tightened to 0700 through its fd (``fchmod``): a directory that existed 0755 does not stay so.
Every refusal is one line naming the directory and what to do (``StateDirUnusable``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("ckptd")

MODE = 0o700
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class StateDirUnusable(Exception):
    """The state directory cannot be used; ``str()`` is one line: what, and what to do."""


def _not_writable(path: Path, exc: OSError) -> StateDirUnusable:
    why = exc.strerror or str(exc)
    return StateDirUnusable(
        f"state dir {path} is not writable ({why}); make it writable, or point --state-dir "
        "elsewhere")


def open_state_dir(path: Path, owner: int) -> int:
    """An fd of the state directory ``path`` (created with its parents when missing),
    owned by uid ``owner`` and mode 0700 (tightened when it was wider). Raises
    ``StateDirUnusable``, keeping the OSError as its cause."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=MODE)
    except FileExistsError as exc:
        raise StateDirUnusable(
            f"state dir {path} exists and is not a directory; remove it, or point "
            "--state-dir elsewhere") from exc
    except OSError as exc:
        raise _not_writable(path, exc) from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StateDirUnusable(
                f"state dir {path} is a symlink (or not a directory), which ckptd does not "
                "follow; point --state-dir at the real directory") from exc
        raise StateDirUnusable(f"cannot open state dir {path}: {exc.strerror or exc}; "
                               "point --state-dir elsewhere") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != owner:
            raise StateDirUnusable(
                f"state dir {path} is owned by uid {st.st_uid}, not {owner} (the daemon's "
                f"user); chown {owner} {path}, or point --state-dir elsewhere")
        mode = stat.S_IMODE(st.st_mode)
        if mode != MODE:
            try:
                os.fchmod(fd, MODE)
            except OSError as exc:
                raise _not_writable(path, exc) from exc
            log.warning("state dir %s had mode %o, now %o", path, mode, MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_lock(dir_fd: int, path: Path) -> int:
    """The lock file ``ckptd.lock`` in the state directory open as ``dir_fd`` (created 0600);
    a directory the daemon cannot write is refused with one line."""
    try:
        return os.open("ckptd.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _READ_ONLY:
            raise _not_writable(path, exc) from exc
        raise StateDirUnusable(f"cannot open the lock file in state dir {path}: "
                               f"{exc.strerror or exc}; point --state-dir elsewhere") from exc
