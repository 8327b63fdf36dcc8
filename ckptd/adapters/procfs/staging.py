"""The RAM staging directory (``fast_staging_dir``), root's alone (issue 33, point 2).

CRIU writes dumps (and restores their checkouts) into it as root, and the daemon removes
what a crash left there at every start; so a user who could plant a link or a directory of
their own on the way could make root delete, or write into, what root protects, or read
other users' memory images as they pass. Hence:

- the staging directory and every directory above it are reached from ``/`` one component
  at a time with openat2(2) (``RESOLVE_NO_SYMLINKS``: a link anywhere is refused, never
  followed; no ``..``), a missing one made with mkdirat(2) (root's; 0755 above, 0700 the
  staging itself) and opened the same way;
- every directory above it is root's, and one that others may write is sticky (``/dev/shm``,
  ``/tmp``: no one else can rename or remove root's entries there); the staging itself is
  root's: else the start is refused in one line (``StagingRefused``). A root-owned staging
  with other bits or group is made root:root 0700 through its fd;
- each daemon takes a subdirectory of its own, named ``<tag>-<random>`` (``tag`` from its
  state directory, for the operator; the random part makes the name unpredictable), and
  holds an flock(2) on it as long as it lives. Under an flock of the staging itself, a
  starting daemon removes every subdirectory whose flock it can take (its daemon is dead),
  fd-relative (no link followed), and only when it is a directory of root's; anything else
  is left, and said.

The default, ``/run/ckptd/staging``, lies under the RuntimeDirectory the systemd unit
(``RuntimeDirectory=ckptd``) and the DaemonSet (the ``/run/ckptd`` hostPath) provide: a tmpfs
of root's that no user can write into.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.adapters.procfs.safefs import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    UnsafePath,
    components,
    openat2,
)

log = logging.getLogger(__name__)

_RESOLVE = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class StagingRefused(ValueError):
    """The staging directory is not root's alone (one line: what and what to do)."""


@dataclass
class FastStaging:
    """This daemon's own subdirectory of the staging directory, flocked while it is open.

    Invariant: as long as ``fd`` is open (the daemon lives), no other daemon removes
    ``path``; the fd is close-on-exec, so no CRIU or guard keeps the lock after the daemon."""

    path: Path
    fd: int
    parent_fd: int = -1
    """The staging directory itself (its subdirectory is removed relative to it)."""
    removed: list[str] = field(default_factory=list)
    """The directories of dead daemons removed when it was taken."""
    left: list[str] = field(default_factory=list)
    """What was found there and left alone (not a directory of root's), said in the log."""

    def close(self) -> None:
        """Let go of the lock (the directory stays: the next start removes it)."""
        for name in ("fd", "parent_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def release(self) -> None:
        """A clean stop: remove this daemon's subdirectory (fd-relative), then close."""
        if self.parent_fd >= 0:
            shutil.rmtree(self.path.name, dir_fd=self.parent_fd, ignore_errors=True)
        self.close()


def claim(staging_dir: str, tag: str) -> FastStaging:
    """This daemon's subdirectory ``<tag>-<random>`` of ``staging_dir``, made 0700 and
    locked, after the stale ones of dead daemons are removed. Raises ``StagingRefused``
    (a ``ValueError``, one line) when the staging directory or the way to it is not root's
    alone, or cannot be made."""
    fd = _open_staging(staging_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one starting daemon at a time cleans and takes
        try:
            removed, left = _remove_stale(fd, staging_dir)
            name = f"{tag}-{secrets.token_hex(8)}"
            os.mkdir(name, 0o700, dir_fd=fd)
            own = openat2(fd, name, _DIR, 0, _RESOLVE)
            fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        os.close(fd)
        raise StagingRefused(f"fast_staging_dir {staging_dir}: cannot take a directory in "
                             f"it: {exc.strerror or exc}") from exc
    return FastStaging(Path(staging_dir) / name, own, fd, removed, left)


def _open_staging(staging_dir: str) -> int:
    """``staging_dir`` opened (made where missing), checked root's alone (see the module)."""
    try:
        parts = components(staging_dir)
    except UnsafePath as exc:
        raise StagingRefused(f"fast_staging_dir {staging_dir!r}: {exc.strerror}; name an "
                             "absolute path such as /run/ckptd/staging (or \"\": always on "
                             "disk)") from exc
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = "/" + "/".join(parts[: i + 1])
            _check_above(fd, "/" + "/".join(parts[:i]), staging_dir)
            nfd = _step(fd, part, where, staging_dir, 0o700 if last else 0o755)
            os.close(fd)
            fd = nfd
        _make_root_only(fd, staging_dir)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(dirfd: int, name: str, where: str, staging_dir: str, mode: int) -> int:
    """``name`` in ``dirfd`` opened as a directory, no link followed; made (``mode``, whatever
    the umask) when missing."""
    made = False
    for _ in range(3):
        try:
            fd = openat2(dirfd, name, _DIR, 0, _RESOLVE)
        except FileNotFoundError:
            try:
                os.mkdir(name, mode, dir_fd=dirfd)  # mkdirat; EEXIST: raced, opened again
                made = True
            except FileExistsError:
                pass
            except OSError as exc:
                raise StagingRefused(f"fast_staging_dir {staging_dir}: cannot create {where}: "
                                     f"{exc.strerror}") from exc
            continue
        except OSError as exc:
            if exc.errno == errno.ENOTDIR and _is_link(dirfd, name):  # O_DIRECTORY said so
                exc = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            raise _refusal(exc, where, staging_dir) from exc
        st = os.fstat(fd)
        if made and st.st_uid == 0 and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        return fd
    raise StagingRefused(f"fast_staging_dir {staging_dir}: {where} keeps changing")


def _is_link(dirfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _refusal(exc: OSError, where: str, staging_dir: str) -> StagingRefused:
    if exc.errno == errno.ELOOP:
        return StagingRefused(
            f"fast_staging_dir {staging_dir}: {where} is a symbolic link; ckptd stages dumps "
            "only in a directory of root's alone: remove the link, or choose another "
            "fast_staging_dir (default /run/ckptd/staging)")
    if exc.errno == errno.ENOTDIR:
        return StagingRefused(f"fast_staging_dir {staging_dir}: {where} is not a directory")
    if exc.errno == errno.ENOSYS:
        return StagingRefused("this kernel has no openat2 (Linux 5.6 or later): ckptd does not "
                              "stage by path as root; set fast_staging_dir = \"\"")
    return StagingRefused(f"fast_staging_dir {staging_dir}: {where}: {exc.strerror}")


def _check_above(fd: int, where: str, staging_dir: str) -> None:
    """A directory on the way: root's, and sticky if others may write it (else they could
    rename what lies below and put their own there)."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != 0:
        raise StagingRefused(
            f"fast_staging_dir {staging_dir}: {where} is owned by uid {st.st_uid}, who could "
            "replace the staging directory; choose one whose every parent is root's (default "
            "/run/ckptd/staging)")
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise StagingRefused(
            f"fast_staging_dir {staging_dir}: {where} is writable by others (mode "
            f"{mode:04o}) and not sticky, so they could replace the staging directory; choose "
            "another fast_staging_dir (default /run/ckptd/staging)")


def _make_root_only(fd: int, staging_dir: str) -> None:
    """The staging directory itself: root's (a user's is refused: what is in it may be
    theirs, and they could read what passes), made root:root 0700 where it is not yet."""
    st = os.fstat(fd)
    if st.st_uid != 0:
        raise StagingRefused(
            f"fast_staging_dir {staging_dir} is owned by uid {st.st_uid}, not root: ckptd "
            "stages memory images only in a directory of root's alone; remove it (the daemon "
            "makes it, root:root 0700) or choose another fast_staging_dir")
    if st.st_gid != 0 or stat.S_IMODE(st.st_mode) != 0o700:
        log.warning("fast_staging_dir %s was %d:%d mode %04o: made root:root 0700",
                    staging_dir, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o700)


def _remove_stale(fd: int, staging_dir: str) -> tuple[list[str], list[str]]:
    """Remove, fd-relative, every subdirectory of the staging (``fd``, flocked) whose daemon
    is dead (its flock free) and that is root's; what else is there is left. Returns the
    paths removed and those left."""
    removed: list[str] = []
    left: list[str] = []
    for name in sorted(os.listdir(fd)):
        path = f"{staging_dir.rstrip('/')}/{name}"
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            left.append(f"{path} (uid {st.st_uid}, mode {st.st_mode:o})")
            continue
        try:
            sub = openat2(fd, name, _DIR, 0, _RESOLVE)
        except OSError:
            left.append(f"{path} (cannot be opened)")
            continue
        try:
            try:
                fcntl.flock(sub, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live daemon's
            if not os.path.samestat(st, os.fstat(sub)):
                continue  # replaced meanwhile (only root can): the next start sees it
            try:
                shutil.rmtree(name, dir_fd=fd)  # fd-relative, never through a link
            except OSError as exc:
                left.append(f"{path} (not all removed: {exc.strerror or exc})")
                continue
            removed.append(path)
        finally:
            os.close(sub)
    return removed, left
