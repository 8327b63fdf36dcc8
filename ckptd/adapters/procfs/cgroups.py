"""The ``Cgroups`` port on the node's cgroup v2 hierarchy: /proc/PID/cgroup and cgroup.procs.

The hierarchy is the cgroup2 file system mounted at its root (``/`` in /proc/self/mountinfo;
e.g. /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host), or the mount point given.
Cgroup paths are as the daemon's cgroup namespace sees them: a process whose cgroup lies
outside it (``0::/../x``) cannot be placed (CgroupUnavailable), nor can one on a host without
cgroup v2 (``find`` returns None there: the daemon then places nothing).

Invariants: a cgroup is created here only by the ``move`` that populates it, under a lock
that ``remove_empty`` takes too, so a sweep never removes a cgroup a ``move`` is about to use;
a cgroup that holds a process or a child is never removed (the kernel refuses the rmdir);
only the ``memory`` and ``pids`` controllers are enabled, and only in a parent this adapter
created (accounting, no limits: ``memory.current``, ``pids.current`` per child).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from ckptd.core.ports import MemoryLimit
from ckptd.errors import CgroupUnavailable, ProcessNotFound

log = logging.getLogger(__name__)

ACCOUNTING = ("memory", "pids")
"""Controllers enabled in a parent cgroup this adapter creates, when its parent offers them."""

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo (space, tab, newline and backslash are octal-escaped)."""
    return _ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


def cgroup2_mounts(mountinfo: str) -> list[tuple[str, Path]]:
    """``(root within the hierarchy, mount point)`` of every cgroup2 mount, in order."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype == "cgroup2":
            mounts.append((_unescape(fields[3]), Path(_unescape(fields[4]))))
    return mounts


def cgroup2_root_with(controller: str, mountinfo: str) -> Path | None:
    """The mount point of the cgroup2 hierarchy's root when ``controller`` is available in
    it (its ``cgroup.controllers``); None when there is no such mount or the controller is
    elsewhere (a hybrid host's v1)."""
    for root, mount in cgroup2_mounts(mountinfo):
        if root != "/":
            continue
        try:
            available = (mount / "cgroup.controllers").read_text().split()
        except OSError:
            return None
        return mount if controller in available else None
    return None


def cgroup_v2_path(proc_cgroup: str) -> str | None:
    """The path of the ``0::`` line of a /proc/PID/cgroup text; None when there is none."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


class CgroupFs:
    """The ``Cgroups`` port on the cgroup2 hierarchy mounted at ``mount``. Thread-safe."""

    def __init__(self, mount: Path, proc: Path = Path("/proc")) -> None:
        self.mount = mount
        self._proc = proc
        self._lock = threading.Lock()

    @classmethod
    def find(
        cls, mount: str = "", mountinfo: Path = Path("/proc/self/mountinfo")
    ) -> CgroupFs | None:
        """The hierarchy at ``mount`` when given (it must be a cgroup2 mount of the whole
        hierarchy), else the first cgroup2 mount of its root; None when there is none."""
        if mount:
            return cls(Path(mount))
        try:
            mounts = cgroup2_mounts(mountinfo.read_text())
        except OSError as exc:
            log.warning("cannot read %s: %s; restored trees are not placed", mountinfo, exc)
            return None
        for root, point in mounts:
            if root == "/":
                return cls(point)
        return None

    # ---- the port -------------------------------------------------------------------------

    def cgroup_of(self, pid: int) -> str:
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessNotFound(f"process {pid} is gone", pid=pid) from exc
        path = cgroup_v2_path(text)
        if path is None:
            raise CgroupUnavailable(
                f"process {pid} is in no cgroup v2 hierarchy", pid=pid,
                hint="ckptd places restored trees in cgroup v2 only",
            )
        if not path.startswith("/") or path == "/.." or path.startswith("/../"):
            raise CgroupUnavailable(
                f"the cgroup of process {pid} ({path}) is outside the daemon's cgroup "
                "namespace", pid=pid,
                hint="run ckptd in the host's cgroup namespace (in a pod: `nsenter "
                     "--cgroup=/proc/1/ns/cgroup`, see deploy/kubernetes)",
            )
        return path

    def move(self, pids: Sequence[int], cgroup: str, *, create: bool = False) -> None:
        target = self._dir(cgroup)
        with self._lock:
            if create:
                self._create(cgroup)
            for pid in pids:
                self._write_procs(target, pid, cgroup)

    def procs(self, cgroup: str) -> tuple[int, ...]:
        try:
            text = (self._dir(cgroup) / "cgroup.procs").read_text()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise CgroupUnavailable(f"cgroup {cgroup} does not exist",
                                    hint="give a path as /proc/PID/cgroup's 0:: line says") from exc
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read the processes of cgroup {cgroup}: "
                                    f"{exc.strerror}") from exc
        return tuple(int(p) for p in text.split())

    def memory_limit(self, pid: int) -> MemoryLimit | None:
        from ckptd.adapters.criu.containers import cgroup_dirs

        try:
            dirs = cgroup_dirs(pid)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessNotFound(f"process {pid} is gone", pid=pid) from exc
        return tightest_memory_limit(dirs)

    def remove_empty(self, parent: str) -> list[str]:
        removed: list[str] = []
        base = self._dir(parent)
        if base == self.mount:
            return removed  # never sweep the whole hierarchy
        with self._lock:
            try:
                children = sorted(p for p in base.iterdir() if p.is_dir())
            except OSError:
                return removed
            for child in children:
                try:
                    child.rmdir()
                except OSError:
                    continue  # populated, has children of its own, or already gone
                removed.append(f"{parent.rstrip('/')}/{child.name}")
        if removed:
            log.info("removed %d empty cgroup(s) under %s", len(removed), parent)
        return removed

    # ---- internals --------------------------------------------------------------------------

    def _dir(self, cgroup: str) -> Path:
        parts = [p for p in cgroup.split("/") if p]
        if not cgroup.startswith("/") or any(p in (".", "..") for p in parts):
            raise CgroupUnavailable(f"{cgroup!r} is not a cgroup path",
                                    hint="give an absolute path such as /ckptd-jobs")
        return self.mount.joinpath(*parts)

    def _create(self, cgroup: str) -> None:
        """``cgroup`` and its missing parents; accounting enabled in each created parent."""
        parts = [p for p in cgroup.split("/") if p]
        here = self.mount
        for i, part in enumerate(parts):
            here = here / part
            try:
                here.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise CgroupUnavailable(
                    f"cannot create cgroup {'/' + '/'.join(parts[: i + 1])}: "
                    f"{exc.strerror or exc}",
                ) from exc
            if i < len(parts) - 1:
                _enable_accounting(here)

    def _write_procs(self, target: Path, pid: int, cgroup: str) -> None:
        try:
            fd = os.open(target / "cgroup.procs", os.O_WRONLY)
        except FileNotFoundError as exc:
            raise CgroupUnavailable(f"cgroup {cgroup} does not exist", pid=pid) from exc
        except OSError as exc:
            raise CgroupUnavailable(f"cannot open {cgroup}/cgroup.procs: {exc.strerror}",
                                    pid=pid) from exc
        try:
            os.write(fd, str(pid).encode())
        except OSError as exc:
            raise _move_error(exc, pid, cgroup) from exc
        finally:
            os.close(fd)


def _move_error(exc: OSError, pid: int, cgroup: str) -> Exception:
    if exc.errno == errno.ESRCH:
        return ProcessNotFound(f"process {pid} is gone", pid=pid)
    if exc.errno == errno.EBUSY:
        return CgroupUnavailable(
            f"cgroup {cgroup} takes no processes: controllers are enabled for its child "
            "cgroups (cgroup v2 puts processes only where no child has controllers)",
            pid=pid, hint="ask from a process in a leaf cgroup (the job's own)",
        )
    if exc.errno == errno.EOPNOTSUPP:
        return CgroupUnavailable(
            f"cgroup {cgroup} takes no processes: it is an invalid domain of a threaded "
            "subtree (cgroup.type)", pid=pid,
            hint="ask from a process in a domain cgroup",
        )
    if exc.errno in (errno.ENOENT, errno.ENODEV):
        return CgroupUnavailable(f"cgroup {cgroup} was removed", pid=pid)
    return CgroupUnavailable(f"cannot move process {pid} into cgroup {cgroup}: "
                             f"{exc.strerror or exc}", pid=pid)


def _enable_accounting(cgroup_dir: Path) -> None:
    """Best effort: ``+memory +pids`` in the subtree control of a cgroup we created (so its
    children account memory and tasks); what its parent does not offer is left out."""
    try:
        offered = set((cgroup_dir / "cgroup.controllers").read_text().split())
    except OSError:
        return
    for name in ACCOUNTING:
        if name not in offered:
            continue
        try:
            (cgroup_dir / "cgroup.subtree_control").write_text(f"+{name}")
        except OSError as exc:
            log.info("cannot enable the %s controller in %s: %s", name, cgroup_dir, exc)


_UNLIMITED_V1 = 1 << 62
"""cgroup v1 says "no limit" with a page-rounded LONG_MAX in ``memory.limit_in_bytes``."""


def tightest_memory_limit(dirs: Sequence[Path]) -> MemoryLimit | None:
    """The limit with the least room left among ``dirs`` (each a cgroup directory of one
    hierarchy) and their ancestors up to the hierarchy's mount: cgroup v2's ``memory.max`` /
    ``memory.current``, v1's ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``; None
    when none is limited."""
    best: MemoryLimit | None = None
    for start in dirs:
        here = start
        while (here / "cgroup.procs").exists():
            found = _limit_in(here)
            if found is not None and (best is None or found.free < best.free):
                best = found
            if here.parent == here:
                break
            here = here.parent
    return best


def _limit_in(directory: Path) -> MemoryLimit | None:
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        try:
            raw = (directory / limit_file).read_text().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= _UNLIMITED_V1:
            return None
        try:
            usage = int((directory / usage_file).read_text().strip())
        except (OSError, ValueError):
            usage = 0
        return MemoryLimit(str(directory), int(raw), usage)
    return None
