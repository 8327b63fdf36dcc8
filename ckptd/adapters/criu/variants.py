"""What a CRIU request says, by variant: a dump or restore on the node (plain), a restore
whose images are streamed from the store, a dump or restore run inside a container.

Each variant is a context manager yielding the ``SwrkCall`` the client runs (its descriptors
are open for the ``with`` block) and doing, around it, what that variant needs: the image
streamer started and its failure said as the checkpoint's, the container opened and CRIU's
log moved out of the images directory. The options shared by all are built by ``dump_opts``
and ``restore_opts``.

Invariant: CRIU is started with an empty plugin directory (CRIU_LIBS_DIR, ``Setup.env``), so
CRIU's own CUDA plugin never acts behind ckptd's back; inside a container CRIU resolves paths
in the container's mount namespace, so every directory is named ``/proc/self/fd/N``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptd._gen.criu import rpc_pb2
from ckptd.adapters.criu import lazyimages, lazypages
from ckptd.adapters.criu.client import DirFd, SwrkCall
from ckptd.adapters.criu.containers import (
    Container,
    ContainerError,
    image_pids,
    make_pids_free,
)
from ckptd.adapters.criu.images import read_tcp_connections, tcp_connections_in
from ckptd.adapters.criu.imgstreamer import ImageStreamer, StreamGuard
from ckptd.adapters.criu.leases import VALIDATION_BY_SIZE, holds_lease
from ckptd.adapters.criu.pageserver import wire_for
from ckptd.core.ports import (
    CriuDumpJob,
    CriuHooks,
    CriuPlacement,
    CriuRestoreJob,
    ForwardingHooks,
    ImageSource,
    LazyPages,
)
from ckptd.errors import CkptdError, CorruptCheckpoint, CriuFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """How every CRIU of this adapter runs."""

    plugin_dir: Path
    log_level: int = 4

    def env(self) -> dict[str, str]:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "CRIU_LIBS_DIR": str(self.plugin_dir)}


# ---- options ----------------------------------------------------------------------------


def _common_opts(
    setup: Setup, images_fd: int, work_fd: int, job: CriuDumpJob | CriuRestoreJob,
    log_file: str,
) -> rpc_pb2.criu_opts:
    """What dumps and restores share: image and work directories, logs, notifications."""
    opts = rpc_pb2.criu_opts(
        images_dir_fd=images_fd,
        shell_job=job.shell_job,
        tcp_established=job.tcp_established,
        ext_unix_sk=job.ext_unix_sk,
        log_level=setup.log_level,
        log_file=log_file,
        notify_scripts=True,
        file_locks=True,
    )
    if work_fd >= 0:
        opts.work_dir_fd = work_fd
    if job.tcp_established:
        # no iptables here: nftables locks the connections (per socket, in the host's
        # network namespace) while CRIU works
        opts.network_lock = rpc_pb2.NFTABLES
    return opts


def dump_opts(setup: Setup, images_fd: int, work_fd: int, job: CriuDumpJob,
              pid: int) -> rpc_pb2.criu_opts:
    """A dump's options, on the node or in a container (``pid`` as CRIU sees it)."""
    opts = _common_opts(setup, images_fd, work_fd, job, "dump.log")
    opts.pid = pid
    opts.leave_running = job.leave_running
    # a file the tree holds whose path was deleted: still linked elsewhere (a hard link),
    # CRIU links it back beside its old path as link_remap.N (the restore opens it there,
    # then removes it; a failed dump removes it); linked nowhere (a ghost, such as PyTorch's
    # shared memory), its content goes into the images, up to ghost_limit bytes
    opts.link_remap = True
    opts.ghost_limit = job.ghost_limit
    # a listening TCP socket with connections the job has not accept()ed yet: CRIU dumps the
    # socket without them (they live in the kernel only; a stopped job loses them anyway, a
    # leave-running one keeps them, a restored one is without them: its clients see a reset
    # and reconnect) instead of refusing the whole dump (zdtm socket-tcp-skip-in-flight)
    opts.tcp_skip_in_flight = True
    if job.leave_stopped:
        opts.leave_stopped = True
    return opts


def restore_opts(setup: Setup, images_fd: int, work_fd: int,
                 job: CriuRestoreJob) -> rpc_pb2.criu_opts:
    """A restore's options, on the node or in a container: stdio replacements, TCP,
    stopped trees, cgroups left alone when the caller placed CRIU."""
    opts = _common_opts(setup, images_fd, work_fd, job, "restore.log")
    for inherit in job.inherit_fds:
        opts.inherit_fd.add(key=inherit.key, fd=inherit.fd)
    if job.tcp_close:
        opts.tcp_close = True
    elif not job.tcp_established and images_hold_connections(job):
        # a checkpoint of an older ckptd that missed a connection (a socket its peer
        # reset): CRIU dumped and locked it with its default (iptables), and restores it
        # only with tcp_established; the same lock method unlocks it
        opts.tcp_established = True
    if job.leave_stopped:
        opts.leave_stopped = True
    if not job.restore_cgroups:
        opts.manage_cgroups_mode = rpc_pb2.IGNORE
    return opts


def images_hold_connections(job: CriuRestoreJob) -> bool:
    """Whether the restore's ``files.img`` (in its directory, or from its streamed source)
    holds a TCP connection; False when it cannot be read."""
    if job.images is None:
        return bool(read_tcp_connections(job.images_dir))
    try:
        if not job.images.exists("files.img"):
            return False
        raw = b"".join(bytes(chunk) for chunk in job.images.chunks("files.img"))
    except (CkptdError, OSError, KeyError):
        return False
    return bool(tcp_connections_in(raw))


# ---- on the node --------------------------------------------------------------------------


@contextlib.contextmanager
def plain_dump(setup: Setup, job: CriuDumpJob, hooks: CriuHooks,
               started: Callable[[int], None] | None = None) -> Iterator[SwrkCall]:
    """CRIU dumps ``job.pid`` from the node; its pages into ``job.page_server_fd`` when set
    (honoured by ``criu swrk`` only)."""
    with DirFd(job.images_dir) as images_fd, DirFd(job.work_dir) as work_fd:
        opts = dump_opts(setup, images_fd, work_fd, job, job.pid)
        if holds_lease(job.pid):  # CRIU's build-id check would open the leased file
            config = job.work_dir / "dump.conf"
            config.write_text(VALIDATION_BY_SIZE)
            opts.config_file = str(config)
        fds: tuple[int, ...] = (images_fd, work_fd)
        if job.page_server_fd >= 0:
            opts.ps.fd = job.page_server_fd
            fds += (job.page_server_fd,)
        yield SwrkCall(rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts), hooks, fds,
                       job.work_dir / "dump.log", f"dump of pid {job.pid}", job.pid,
                       setup.env(), started=started)


@contextlib.contextmanager
def plain_restore(setup: Setup, job: CriuRestoreJob, hooks: CriuHooks,
                  config_file: Path | None = None) -> Iterator[SwrkCall]:
    """CRIU restores from ``job.images_dir`` on the node (``config_file``: CRIU's RPC
    configuration file, read for what RPC cannot say)."""
    with DirFd(job.images_dir) as images_fd, DirFd(job.work_dir) as work_fd:
        opts = restore_opts(setup, images_fd, work_fd, job)
        if config_file is not None:
            opts.config_file = str(config_file)
        fds = (images_fd, work_fd, *(i.fd for i in job.inherit_fds))
        yield SwrkCall(rpc_pb2.criu_req(type=rpc_pb2.RESTORE, opts=opts), hooks, fds,
                       job.work_dir / "restore.log", "restore", None, setup.env(),
                       started=hooks.criu_started)


# ---- streamed -----------------------------------------------------------------------------


@contextlib.contextmanager
def streamed_restore(setup: Setup, job: CriuRestoreJob, images: ImageSource,
                     hooks: CriuHooks) -> Iterator[SwrkCall]:
    """CRIU reads every image from ``images`` through its image-streamer protocol
    (``imgstreamer``), switched on by an RPC configuration file (``stream``). A failure
    of the source refuses CRIU's post-restore (and pre-resume) notification, so CRIU
    kills what it created before any of it ran; it is raised naming the checkpoint and
    the object, CRIU's own failure as its cause."""
    config = job.work_dir / "stream.conf"
    config.write_text("stream\n")
    streamer = ImageStreamer(job.images_dir, images)
    streamer.start()
    try:
        with plain_restore(setup, job, StreamGuard(hooks, streamer), config) as swrk:
            yield swrk
    except CriuFailed as exc:
        streamer.close()
        error = streamer.error
        if error is None:
            raise
        raise CorruptCheckpoint(
            f"{error.message} (the streamed restore was undone before any process of "
            f"it ran; {exc.message})", hint=error.hint,
            checkpoint_id=images.checkpoint_id,
        ) from error
    finally:
        streamer.close()
    if streamer.error is not None:  # after pre-resume: the tree runs, CRIU read it all
        log.warning("streamed restore of %s: %s (after the tree had been restored)",
                    images.checkpoint_id, streamer.error)
    log.info("streamed restore of %s: %d images read from the store, %d absent",
             images.checkpoint_id, len(streamer.served), len(streamer.missing))


@contextlib.contextmanager
def lazy_restore(setup: Setup, criu_path: str, criu_version: str, job: CriuRestoreJob,
                 images: ImageSource, lazy: LazyPages, hooks: CriuHooks) -> Iterator[SwrkCall]:
    """CRIU restores without the pages of anonymous private memory, which ``lazypages``
    serves from ``images`` once the tree runs (the module's doc): the images staged, CRIU's
    lazy-pages daemon started (placed as CRIU is: ``hooks.criu_started``) and served from
    before the restore begins (a task may touch a page as soon as CRIU resumes it). A
    failed restore stops the daemon: CRIU killed what it created, no task waits on a page."""
    t0 = time.monotonic()
    maps = lazyimages.stage(images, job.images_dir)
    t1 = time.monotonic()
    daemon = lazypages.LazyDaemon(criu_path, job.images_dir, job.work_dir, setup.env(),
                                  setup.log_level)
    daemon.start(hooks.criu_started)
    log.info("lazy restore of %s: images staged in %.3fs, CRIU's page daemon ready in %.3fs",
             images.checkpoint_id, t1 - t0, time.monotonic() - t1)
    assert daemon.proc is not None and daemon.sock is not None
    lazy.started(daemon.proc.pid)
    serving = lazypages.PageServing(daemon.sock, images, maps, wire_for(criu_version))
    copies = lazypages.UffdCopies()
    lazypages.LazyRun(daemon, serving, lazy.failed, lazy.done, copies).begin()
    config = job.work_dir / "lazy.conf"
    config.write_text("lazy-pages\n")
    try:
        with plain_restore(setup, job, _TakeUffds(hooks, copies, daemon.proc.pid),
                           config) as swrk:
            yield swrk
    except BaseException:
        daemon.kill()
        copies.close()
        raise


class _TakeUffds(ForwardingHooks):
    """At post-restore (the tree exists, has not run), ckptd's copies of the lazy-pages
    daemon's userfaultfds are taken first (``lazypages.UffdCopies``); failing, CRIU undoes
    the restore."""

    def __init__(self, inner: CriuHooks, copies: lazypages.UffdCopies, daemon_pid: int) -> None:
        super().__init__(inner)
        self._copies = copies
        self._daemon_pid = daemon_pid

    def post_restore(self, pid: int) -> None:
        taken = self._copies.take(self._daemon_pid)
        log.debug("lazy restore: %d userfaultfd(s) of the page daemon held", taken)
        super().post_restore(pid)


# ---- in a container -----------------------------------------------------------------------


@contextlib.contextmanager
def dump_in_container(setup: Setup, job: CriuDumpJob, where: CriuPlacement,
                      hooks: CriuHooks) -> Iterator[SwrkCall]:
    """CRIU run inside the container (docs/design/containers.md): it resolves paths in
    the container's mount namespace and descriptors by the peer's pid (0 there), so the
    images directory is named ``/proc/self/fd/N`` and there is no work directory: CRIU
    writes its log and stats among the images, moved to ``work_dir`` once it exits."""
    container = open_container(where, f"dump of pid {job.pid}", job.pid,
                               "the job's container is gone or cannot be entered")
    setup.plugin_dir.mkdir(parents=True, exist_ok=True)
    with container, DirFd(job.images_dir) as images_fd, DirFd(setup.plugin_dir) as plugins_fd:
        opts = dump_opts(setup, -1, -1, job, where.ns_pid)
        opts.images_dir = f"/proc/self/fd/{images_fd}"
        opts.manage_cgroups_mode = rpc_pb2.IGNORE

        def node_pid(ns_pid: int) -> int:
            return job.pid if ns_pid == where.ns_pid else 0

        with _logs_moved(job.images_dir, job.work_dir, ("dump.log", "dump.stderr",
                                                       "stats-dump")):
            yield SwrkCall(
                rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts), hooks,
                (images_fd, plugins_fd), job.images_dir / "dump.log",
                f"dump of pid {job.pid}", job.pid,
                {**setup.env(), "CRIU_LIBS_DIR": f"/proc/self/fd/{plugins_fd}"},
                container=container, notified_pid=node_pid)


@contextlib.contextmanager
def restore_in_container(setup: Setup, job: CriuRestoreJob, where: CriuPlacement,
                         hooks: CriuHooks) -> Iterator[SwrkCall]:
    """CRIU run inside the container of ``where.init`` (its namespaces and cgroups), as
    for a dump; before it starts, every pid and thread id of the images is checked free
    there and the namespace's counter moved past them (CRIU's clone3 needs each exact
    pid). The call's ``node_pid`` maps the restored root's pid to the node's while the
    ``with`` block lasts."""
    what = f"restore into the container of pid {where.init}"
    container = open_container(where, what, where.init, "the container restored into is gone")
    setup.plugin_dir.mkdir(parents=True, exist_ok=True)
    with container, DirFd(job.images_dir) as images_fd, DirFd(setup.plugin_dir) as plugins_fd:
        try:
            make_pids_free(container, image_pids(job.images_dir))
        except (ContainerError, OSError) as exc:
            raise CriuFailed(f"CRIU {what}: {exc}", pid=where.init,
                             hint="start the job with `ckptctl run` (its pids are then "
                                  "above those a container's own processes take)") from exc
        opts = restore_opts(setup, -1, -1, job)
        opts.images_dir = f"/proc/self/fd/{images_fd}"
        opts.manage_cgroups_mode = rpc_pb2.IGNORE  # the container's cgroups, always

        def node_pid(ns_pid: int) -> int:
            return container.node_pids().get(ns_pid, 0)

        with _logs_moved(job.images_dir, job.work_dir, ("restore.log", "restore.stderr")):
            yield SwrkCall(
                rpc_pb2.criu_req(type=rpc_pb2.RESTORE, opts=opts), hooks,
                (images_fd, plugins_fd, *(i.fd for i in job.inherit_fds)),
                job.images_dir / "restore.log", what, None,
                {**setup.env(), "CRIU_LIBS_DIR": f"/proc/self/fd/{plugins_fd}"},
                started=hooks.criu_started, container=container, notified_pid=node_pid)


@contextlib.contextmanager
def _logs_moved(images_dir: Path, work_dir: Path, names: tuple[str, ...]) -> Iterator[None]:
    """CRIU's files written among the images moved to ``work_dir`` once it has exited; a
    failure names the log where it will be (the first name)."""
    try:
        yield
    except CriuFailed as exc:
        if exc.log_path:
            exc.log_path = str(work_dir / names[0])
            exc.hint = f"see {exc.log_path}"
        raise
    finally:
        for name in names:
            with contextlib.suppress(OSError):  # staging may be another file system
                shutil.move(images_dir / name, work_dir / name)


def open_container(where: CriuPlacement, what: str, pid: int, gone_hint: str) -> Container:
    """The container of ``where.init``, its namespaces pinned; CriuFailed when it is gone, or
    when its init's pid now names another process."""
    try:
        container = Container.open(where.init)
    except ContainerError as exc:
        raise CriuFailed(f"CRIU {what}: {exc}", pid=pid, hint=gone_hint) from exc
    if container.start_time != where.init_start_time:
        container.close()
        raise CriuFailed(f"CRIU {what}: the container's init (pid {where.init}) is another "
                         "process now", pid=pid, hint=gone_hint)
    return container
