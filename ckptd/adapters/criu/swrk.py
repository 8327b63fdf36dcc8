"""The ``Criu`` port over ``criu swrk``: CRIU's status, and each dump or restore as one
request of the thin client (``client``) built by its variant (``variants``: plain, streamed,
in a container); a dump held at post-dump is ``held_dump``'s, CRIU's log is read by ``logs``.

Invariants: CRIU runs in a new session with an empty plugin directory (see ``client`` and
``variants``); every failure becomes ``CriuFailed`` with CRIU's errno, message and the tail of
its log, or ``CriuUnavailable`` when CRIU cannot run at all (checked before each request).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptd._gen.criu import rpc_pb2
from ckptd.adapters.criu import client, lockimages, pathimages, variants
from ckptd.adapters.criu.client import SwrkCall
from ckptd.adapters.criu.held_dump import SwrkDump
from ckptd.adapters.criu.logs import log_tail_text
from ckptd.core.ports import CriuDumpJob, CriuHooks, CriuPaths, CriuRestoreJob, ImageSource
from ckptd.domain import CriuStatus
from ckptd.errors import CorruptCheckpoint, CriuFailed, CriuUnavailable

MIN_VERSION = (4, 1)
log = logging.getLogger(__name__)


class CriuSwrk:
    """The ``Criu`` port over ``criu swrk``. Thread-safe: each call runs its own CRIU."""

    def __init__(
        self, criu_path: str, *, plugin_dir: Path, log_level: int = 4,
        enter_preload: Path | None = None,
    ) -> None:
        self._path = criu_path
        self._preload = enter_preload
        self._setup = variants.Setup(plugin_dir, log_level)
        self._status: CriuStatus | None = None
        self._status_at = 0.0
        self._status_lock = threading.Lock()
        self._streams: bool | None = None
        self._lazy: bool | None = None

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> CriuStatus:
        """CRIU's path, version and whether ``criu check`` passes. A good answer is kept; a
        bad one is asked again after a few seconds (someone may be installing CRIU)."""
        with self._status_lock:
            fresh = self._status is not None and (
                self._status.ok or time.monotonic() - self._status_at < 5.0
            )
            if not fresh:
                self._status = self._probe()
                self._status_at = time.monotonic()
            assert self._status is not None
            return self._status

    def _probe(self) -> CriuStatus:
        path = self._path
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            return CriuStatus(path, "", False, f"CRIU not found at {path}")
        try:
            out = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return CriuStatus(path, "", False, f"cannot run {path}: {exc}")
        match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not match:
            return CriuStatus(path, "", False, f"{path} --version printed no version")
        version = ".".join(g for g in match.groups() if g is not None)
        if (int(match[1]), int(match[2])) < MIN_VERSION:
            return CriuStatus(
                path, version, False,
                f"CRIU {version} at {path} is too old: ckptd needs CRIU >= "
                f"{MIN_VERSION[0]}.{MIN_VERSION[1]} (kernels >= 6.13 changed the vDSO layout)",
            )
        try:
            check = subprocess.run(
                [path, "check"], capture_output=True, text=True, timeout=60, check=False,
                env=self._env(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return CriuStatus(path, version, False, f"`criu check` could not run: {exc}")
        if check.returncode != 0:
            detail = log_tail_text(check.stderr + check.stdout)
            return CriuStatus(path, version, False, f"`{path} check` failed: {detail}")
        return CriuStatus(path, version, True, "Looks good.")

    def feature(self, name: str) -> bool:
        """Whether ``criu check --feature NAME`` passes (e.g. ``mem_dirty_track``)."""
        try:
            return subprocess.run(
                [self._path, "check", "--feature", name], capture_output=True, timeout=30,
                check=False, env=self._env(),
            ).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    # ---- dump / restore ----------------------------------------------------------------

    def dump(self, job: CriuDumpJob, hooks: CriuHooks) -> SwrkDump:
        """CRIU dumps in a thread of its own and holds at post-dump until ``finish`` or
        ``abort`` (see ``CriuDumpInProgress``)."""
        streams = job.page_sink is not None and job.container is None
        version = self.status().version if streams else ""
        dump = SwrkDump(self._run_dump, version, job, hooks)
        dump.start()
        return dump

    def _run_dump(
        self, job: CriuDumpJob, hooks: CriuHooks, started: Callable[[int], None] | None,
    ) -> None:
        if job.container is None:
            with variants.plain_dump(self._setup, job, hooks, started) as swrk:
                self._call(swrk)
            return
        if job.page_server_fd >= 0 or job.page_sink is not None:
            raise CriuFailed("CRIU dump into a page server: not for container jobs",
                             pid=job.pid, hint="")
        with variants.dump_in_container(self._setup, job, job.container, hooks) as swrk:
            self._call(swrk)

    def restore_paths(self, images_dir: Path, images: ImageSource | None) -> CriuPaths:
        found = pathimages.read_restore_paths(images_dir, images)
        if found.unreadable:
            raise CorruptCheckpoint(
                f"CRIU's image {found.unreadable} cannot be read: ckptd cannot tell which paths "
                "CRIU would open as root", hint="run `ckptctl verify` on the checkpoint")
        return found.paths

    def lost_locks(self, images_dir: Path) -> tuple[str, ...]:
        return lockimages.lost_locks(images_dir)

    def can_stream_restore(self) -> bool:
        """This CRIU streams a restore's images through RPC (our patch, scripts/criu-patches:
        ``criu check --feature rpc_stream``). Asked once."""
        if self._streams is None:  # asked outside the lock: status() never waits for it
            self._streams = self.feature("rpc_stream")
        return self._streams

    def warm_up(self) -> None:
        """Ask CRIU now what ``can_stream_restore`` and ``lazy_restores`` will be asked (a
        thread at the daemon's start: the first restore then pays no ``criu check``)."""
        try:
            self.can_stream_restore()
            self.lazy_restores()
        except Exception:  # a CRIU that cannot run: said by status(), asked again later
            log.debug("asking CRIU's features failed", exc_info=True)

    def lazy_restores(self) -> bool:
        """This kernel and CRIU can restore lazily (``criu check --feature uffd-noncoop``:
        userfaultfd with fork, remap and exit events). Asked once."""
        if self._lazy is None:  # (two threads asking at once both ask CRIU: harmless)
            self._lazy = self.feature("uffd-noncoop")
        return self._lazy

    def restore(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        """The restored root's pid (the node's)."""
        if job.lazy is not None:
            if job.images is None or job.container is not None:
                raise CriuFailed("a lazy restore reads its images from the store, on the node",
                                 hint="restore without --lazy")
            if not self.lazy_restores():
                raise CriuUnavailable(
                    f"CRIU at {self._path} cannot restore lazily here (`criu check --feature "
                    "uffd-noncoop` fails: this kernel's userfaultfd lacks what it needs)")
            variant = variants.lazy_restore(self._setup, self._path, self.status().version,
                                            job, job.images, job.lazy, hooks)
        elif job.images is not None:
            if job.container is not None:
                raise CriuFailed("a streamed restore inside a container is not supported",
                                 hint="restore from an image directory")
            if not self.can_stream_restore():
                raise CriuUnavailable(
                    f"CRIU at {self._path} cannot stream a restore through RPC (it lacks "
                    "scripts/criu-patches; run scripts/install-criu.sh)")
            variant = variants.streamed_restore(self._setup, job, job.images, hooks)
        elif job.container is not None:
            variant = variants.restore_in_container(self._setup, job, job.container, hooks)
        else:
            variant = variants.plain_restore(self._setup, job, hooks)
        with variant as swrk:
            return swrk.node_pid(int(self._call(swrk).restore.pid))

    def _call(self, swrk: SwrkCall) -> rpc_pb2.criu_resp:
        status = self.status()
        if not status.ok:
            raise CriuUnavailable(status.message, pid=swrk.pid)
        return client.call(self._path, self._preload, swrk)

    def _env(self) -> dict[str, str]:
        return self._setup.env()
