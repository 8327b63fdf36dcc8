"""CRIU driven over its RPC protocol: ``criu swrk <fd>`` on a SOCK_SEQPACKET socketpair.

One request per CRIU process. With ``notify_scripts`` CRIU stops at each notification
("pre-dump", "post-dump", "post-restore", ...), sends a NOTIFY message and waits for our reply;
each is routed to a ``CriuHooks`` method, and a hook that raises is answered with
``notify_success = false`` so CRIU aborts (and undoes) the operation.

Invariants: CRIU runs in a new session (restored trees land there, not in the daemon's); it is
started with an empty plugin directory (CRIU_LIBS_DIR), so CRIU's own CUDA plugin never acts
behind ckptd's back; every failure becomes ``CriuFailed`` with CRIU's errno, message and the
tail of its log, or ``CriuUnavailable`` when CRIU cannot run at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ckptd._gen.criu import rpc_pb2
from ckptd.adapters.criu.causes import explain
from ckptd.adapters.criu.containers import (
    Container,
    ContainerError,
    image_pids,
    make_pids_free,
)
from ckptd.adapters.criu.images import (
    read_dump_stats,
    read_pstree,
    read_tcp_connections,
    tcp_connections_in,
)
from ckptd.adapters.criu.imgstreamer import ImageStreamer, StreamGuard
from ckptd.adapters.criu.pageserver import PageServer, PageServerError, wire_for
from ckptd.core.ports import (
    CriuDumpJob,
    CriuDumpResult,
    CriuHooks,
    CriuPlacement,
    CriuRestoreJob,
    ImageSource,
)
from ckptd.domain import CriuStatus, TcpConnection
from ckptd.errors import CkptdError, CorruptCheckpoint, CriuFailed, CriuUnavailable

log = logging.getLogger(__name__)

MIN_VERSION = (4, 1)
LOG_TAIL_LINES = 25
_HARMLESS = (
    "RLIMIT_NOFILE",  # CAP_SYS_RESOURCE missing: CRIU says so and carries on
    "tun: Unable to create tun",  # kerndat's probe inside a container without /dev/net/tun
    # a restore inside a container unlocks the nftables table CRIU made in the old one's
    # network namespace, which the new one does not have
    "Could not process rule: No such file or directory",
    "delete table inet CRIU-",
)


def _hook_table(hooks: CriuHooks) -> dict[str, Callable[[int], None]]:
    return {
        "pre-dump": hooks.pre_dump,
        "network-lock": hooks.network_lock,
        "post-dump": hooks.post_dump,
        "network-unlock": hooks.network_unlock,
        "pre-restore": hooks.pre_restore,
        "setup-namespaces": hooks.setup_namespaces,
        "post-restore": hooks.post_restore,
        "pre-resume": hooks.pre_resume,
        "post-resume": hooks.post_resume,
    }


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a CRIU log, harmless noise left out."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if not any(h in ln for h in _HARMLESS)]
    return "\n".join(kept[-lines:])


_ERROR_RE = re.compile(r"\bError \([^)]*\):\s*(.*)$")
_SUMMARY = ("Dumping FAILED.", "Restoring FAILED.")  # CRIU's last words, not a cause


def first_error(path: Path) -> str:
    """The text of the first error in a CRIU log that is neither harmless nor CRIU's final
    "Dumping FAILED." summary (e.g. "unix: External socket is used. ..."); "" if none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        match = _ERROR_RE.search(line)
        if match and not _is_harmless(line) and match[1].strip() not in _SUMMARY:
            return match[1].strip()
    return ""


class CriuSwrk:
    """The ``Criu`` port over ``criu swrk``. Thread-safe: each call runs its own CRIU."""

    def __init__(
        self, criu_path: str, *, plugin_dir: Path, log_level: int = 4,
        enter_preload: Path | None = None,
    ) -> None:
        self._path = criu_path
        self._preload = enter_preload
        self._plugin_dir = plugin_dir
        self._log_level = log_level
        self._status: CriuStatus | None = None
        self._status_at = 0.0
        self._status_lock = threading.Lock()
        self._streams: bool | None = None

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

    def dump(self, job: CriuDumpJob, hooks: CriuHooks) -> _SwrkDump:
        """CRIU dumps in a thread of its own and holds at post-dump until ``finish`` or
        ``abort`` (see ``CriuDumpInProgress``)."""
        dump = _SwrkDump(self, job, hooks)
        dump.start()
        return dump

    def _run_dump(
        self, job: CriuDumpJob, hooks: CriuHooks,
        started: Callable[[int], None] | None = None,
    ) -> None:
        if job.container is not None:
            if job.page_server_fd >= 0 or job.page_sink is not None:
                raise CriuFailed("CRIU dump into a page server: not for container jobs",
                                 pid=job.pid, hint="")
            self._run_dump_in_container(job, job.container, hooks)
            return
        with _DirFd(job.images_dir) as images_fd, _DirFd(job.work_dir) as work_fd:
            opts = self._opts(images_fd, work_fd, job, "dump.log")
            opts.pid = job.pid
            opts.leave_running = job.leave_running
            # a file the tree holds whose path was deleted: still linked elsewhere (a hard
            # link), CRIU links it back beside its old path as link_remap.N (the restore
            # opens it there, then removes it; a failed dump removes it); linked nowhere (a
            # ghost, such as PyTorch's shared memory), its content goes into the images, up
            # to ghost_limit bytes
            opts.link_remap = True
            opts.ghost_limit = job.ghost_limit
            if job.leave_stopped:
                opts.leave_stopped = True
            fds: tuple[int, ...] = (images_fd, work_fd)
            if job.page_server_fd >= 0:
                opts.ps.fd = job.page_server_fd  # honoured by `criu swrk` only
                fds += (job.page_server_fd,)
            req = rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts)
            self._call(req, hooks, fds, job.work_dir / "dump.log",
                       f"dump of pid {job.pid}", job.pid, started=started)

    def _run_dump_in_container(
        self, job: CriuDumpJob, where: CriuPlacement, hooks: CriuHooks
    ) -> None:
        """CRIU run inside the container (docs/design/containers.md): it resolves paths in
        the container's mount namespace and descriptors by the peer's pid (0 there), so the
        images directory is named ``/proc/self/fd/N`` and there is no work directory: CRIU
        writes its log and stats among the images, moved to ``work_dir`` once it exits."""
        container = _open_container(where, f"dump of pid {job.pid}", job.pid,
                                    "the job's container is gone or cannot be entered")
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        with container, _DirFd(job.images_dir) as images_fd, \
                _DirFd(self._plugin_dir) as plugins_fd:
            opts = self._opts(-1, -1, job, "dump.log")
            opts.images_dir = f"/proc/self/fd/{images_fd}"
            opts.pid = where.ns_pid
            opts.leave_running = job.leave_running
            opts.link_remap = True
            opts.ghost_limit = job.ghost_limit
            opts.manage_cgroups_mode = rpc_pb2.IGNORE
            if job.leave_stopped:
                opts.leave_stopped = True
            req = rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts)

            def node_pid(ns_pid: int) -> int:
                return job.pid if ns_pid == where.ns_pid else 0

            try:
                self._call(req, hooks, (images_fd, plugins_fd), job.images_dir / "dump.log",
                           f"dump of pid {job.pid}", job.pid, container=container,
                           notified_pid=node_pid,
                           env={**self._env(), "CRIU_LIBS_DIR": f"/proc/self/fd/{plugins_fd}"})
            except CriuFailed as exc:  # its log is moved to the work directory (below)
                if exc.log_path:
                    exc.log_path = str(job.work_dir / "dump.log")
                    exc.hint = f"see {exc.log_path}"
                raise
            finally:
                for name in ("dump.log", "dump.stderr", "stats-dump"):
                    with contextlib.suppress(OSError):  # staging may be another file system
                        shutil.move(job.images_dir / name, job.work_dir / name)

    def can_stream_restore(self) -> bool:
        """This CRIU streams a restore's images through RPC (our patch, scripts/criu-patches:
        ``criu check --feature rpc_stream``). Asked once."""
        with self._status_lock:
            if self._streams is None:
                self._streams = self.feature("rpc_stream")
            return self._streams

    def restore(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        if job.images is not None:
            return self._restore_streamed(job, job.images, hooks)
        if job.container is not None:
            return self._restore_in_container(job, job.container, hooks)
        with _DirFd(job.images_dir) as images_fd, _DirFd(job.work_dir) as work_fd:
            opts = self._restore_opts(images_fd, work_fd, job)
            req = rpc_pb2.criu_req(type=rpc_pb2.RESTORE, opts=opts)
            fds = (images_fd, work_fd, *(i.fd for i in job.inherit_fds))
            resp = self._call(req, hooks, fds, job.work_dir / "restore.log", "restore", None,
                              started=hooks.criu_started)
        return int(resp.restore.pid)

    def _restore_streamed(self, job: CriuRestoreJob, images: ImageSource,
                          hooks: CriuHooks) -> int:
        """CRIU reads every image from ``images`` through its image-streamer protocol
        (``imgstreamer``), switched on by an RPC configuration file (``stream``). A failure
        of the source refuses CRIU's post-restore (and pre-resume) notification, so CRIU
        kills what it created before any of it ran; it is raised naming the checkpoint and
        the object, CRIU's own failure as its cause."""
        if job.container is not None:
            raise CriuFailed("a streamed restore inside a container is not supported",
                             hint="restore from an image directory")
        if not self.can_stream_restore():
            raise CriuUnavailable(f"CRIU at {self._path} cannot stream a restore through RPC "
                                  "(it lacks scripts/criu-patches; run scripts/install-criu.sh)")
        config = job.work_dir / "stream.conf"
        config.write_text("stream\n")
        streamer = ImageStreamer(job.images_dir, images)
        streamer.start()
        try:
            with _DirFd(job.images_dir) as images_fd, _DirFd(job.work_dir) as work_fd:
                opts = self._restore_opts(images_fd, work_fd, job)
                opts.config_file = str(config)
                req = rpc_pb2.criu_req(type=rpc_pb2.RESTORE, opts=opts)
                fds = (images_fd, work_fd, *(i.fd for i in job.inherit_fds))
                resp = self._call(req, StreamGuard(hooks, streamer), fds,
                                  job.work_dir / "restore.log", "restore", None,
                                  started=hooks.criu_started)
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
        return int(resp.restore.pid)

    def _restore_in_container(
        self, job: CriuRestoreJob, where: CriuPlacement, hooks: CriuHooks
    ) -> int:
        """CRIU run inside the container of ``where.init`` (its namespaces and cgroups), as
        for a dump; before it starts, every pid and thread id of the images is checked free
        there and the namespace's counter moved past them (CRIU's clone3 needs each exact
        pid). Returns the restored root's node pid."""
        what = f"restore into the container of pid {where.init}"
        container = _open_container(where, what, where.init,
                                    "the container restored into is gone")
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        with container, _DirFd(job.images_dir) as images_fd, \
                _DirFd(self._plugin_dir) as plugins_fd:
            try:
                make_pids_free(container, image_pids(job.images_dir))
            except (ContainerError, OSError) as exc:
                raise CriuFailed(f"CRIU {what}: {exc}", pid=where.init,
                                 hint="start the job with `ckptctl run` (its pids are then "
                                      "above those a container's own processes take)") from exc
            opts = self._restore_opts(-1, -1, job)
            opts.images_dir = f"/proc/self/fd/{images_fd}"
            opts.manage_cgroups_mode = rpc_pb2.IGNORE  # the container's cgroups, always
            req = rpc_pb2.criu_req(type=rpc_pb2.RESTORE, opts=opts)

            def node_pid(ns_pid: int) -> int:
                return container.node_pids().get(ns_pid, 0)

            log_path = job.images_dir / "restore.log"
            try:
                resp = self._call(
                    req, hooks, (images_fd, plugins_fd, *(i.fd for i in job.inherit_fds)),
                    log_path, what, None, started=hooks.criu_started, container=container,
                    notified_pid=node_pid,
                    env={**self._env(), "CRIU_LIBS_DIR": f"/proc/self/fd/{plugins_fd}"})
            except CriuFailed as exc:
                if exc.log_path:
                    exc.log_path = str(job.work_dir / "restore.log")
                    exc.hint = f"see {exc.log_path}"
                raise
            finally:
                for name in ("restore.log", "restore.stderr"):
                    with contextlib.suppress(OSError):
                        shutil.move(job.images_dir / name, job.work_dir / name)
            return node_pid(int(resp.restore.pid))

    def _restore_opts(
        self, images_fd: int, work_fd: int, job: CriuRestoreJob
    ) -> rpc_pb2.criu_opts:
        """A restore's options, on the node or in a container: stdio replacements, TCP,
        stopped trees, cgroups left alone when the caller placed CRIU."""
        opts = self._opts(images_fd, work_fd, job, "restore.log")
        for inherit in job.inherit_fds:
            opts.inherit_fd.add(key=inherit.key, fd=inherit.fd)
        if job.tcp_close:
            opts.tcp_close = True
        elif not job.tcp_established and _images_hold_connections(job):
            # a checkpoint of an older ckptd that missed a connection (a socket its peer
            # reset): CRIU dumped and locked it with its default (iptables), and restores it
            # only with tcp_established; the same lock method unlocks it
            opts.tcp_established = True
        if job.leave_stopped:
            opts.leave_stopped = True
        if not job.restore_cgroups:
            opts.manage_cgroups_mode = rpc_pb2.IGNORE
        return opts

    def _opts(
        self, images_fd: int, work_fd: int, job: CriuDumpJob | CriuRestoreJob, log_file: str
    ) -> rpc_pb2.criu_opts:
        """What dumps and restores share: image and work directories, logs, notifications."""
        opts = rpc_pb2.criu_opts(
            images_dir_fd=images_fd,
            shell_job=job.shell_job,
            tcp_established=job.tcp_established,
            ext_unix_sk=job.ext_unix_sk,
            log_level=self._log_level,
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

    # ---- the protocol ------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "CRIU_LIBS_DIR": str(self._plugin_dir)}

    def _call(
        self,
        req: rpc_pb2.criu_req,
        hooks: CriuHooks,
        fds: tuple[int, ...],
        log_path: Path,
        what: str,
        pid: int | None,
        started: Callable[[int], None] | None = None,
        container: Container | None = None,
        notified_pid: Callable[[int], int] | None = None,
        env: dict[str, str] | None = None,
    ) -> rpc_pb2.criu_resp:
        """Run one CRIU for ``req``. ``started(criu's pid)`` runs before CRIU is sent the
        request (it waits for it, having done nothing yet); if it raises, CRIU is sent nothing
        and exits, and the error is raised as CriuFailed (its cause kept). ``container``: CRIU
        runs inside it (its namespaces and cgroups, loaded from the node with the preload);
        ``notified_pid`` maps the pids of CRIU's notifications to the daemon's."""
        status = self.status()
        if not status.ok:
            raise CriuUnavailable(status.message, pid=pid)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stderr_path = log_path.with_suffix(".stderr")
        try:
            with open(stderr_path, "wb") as stderr:
                argv = [self._path, "swrk", str(theirs.fileno())]
                entry: tuple[int, ...] = ()
                if container is not None:
                    argv, entry = container.command(argv, preload=self._preload)
                try:
                    proc = subprocess.Popen(
                        argv,
                        pass_fds=(theirs.fileno(), *fds, *entry),
                        stdin=subprocess.DEVNULL,
                        stdout=stderr,
                        stderr=stderr,
                        start_new_session=True,
                        env=env if env is not None else self._env(),
                    )
                except OSError as exc:
                    raise CriuUnavailable(f"cannot start {self._path}: {exc}", pid=pid) from exc
            theirs.close()
            try:
                if started is not None:
                    _run_started(started, proc.pid, what, log_path, pid)
                resp = self._converse(ours, req, hooks, what, log_path, pid, notified_pid)
            finally:
                ours.close()
                proc.wait()
        finally:
            theirs.close()
        return resp

    def _converse(
        self,
        sock: socket.socket,
        req: rpc_pb2.criu_req,
        hooks: CriuHooks,
        what: str,
        log_path: Path,
        pid: int | None,
        notified_pid: Callable[[int], int] | None = None,
    ) -> rpc_pb2.criu_resp:
        table = _hook_table(hooks)
        sock.send(req.SerializeToString())
        hook_error: BaseException | None = None
        while True:
            resp = _receive(sock)
            if resp is None:
                raise CriuFailed(
                    f"CRIU {what} failed: CRIU exited without answering",
                    log_tail=log_tail(log_path), log_path=str(log_path), pid=pid,
                    hint=f"see {log_path}",
                )
            if resp.type != rpc_pb2.NOTIFY:
                break
            ok = True
            hook = table.get(resp.notify.script)
            if hook is not None and hook_error is None:
                try:
                    npid = resp.notify.pid
                    hook(notified_pid(npid) if notified_pid is not None else npid)
                except Exception as exc:
                    log.exception("hook %s failed", resp.notify.script)
                    hook_error, ok = exc, False
            reply = rpc_pb2.criu_req(type=rpc_pb2.NOTIFY, notify_success=ok)
            sock.send(reply.SerializeToString())
        if resp.success and hook_error is None:
            return resp
        tail = log_tail(log_path)
        errno = resp.cr_errno if resp.HasField("cr_errno") else None
        # cr_errmsg is CRIU's *first* error; here that is the harmless RLIMIT_NOFILE line, so
        # the cause is then the first other error of the log.
        detail = resp.cr_errmsg if resp.cr_errmsg and not _is_harmless(resp.cr_errmsg) else ""
        detail = detail or first_error(log_path)
        detail = detail or (os.strerror(errno) if errno else "see its log")
        if hook_error is not None:
            raise CriuFailed(
                f"CRIU {what} aborted: {hook_error}", errno=errno, log_tail=tail,
                log_path=str(log_path), pid=pid, hint=f"see {log_path}",
            ) from hook_error
        ghost_limit = req.opts.ghost_limit if req.HasField("opts") else None
        cause = explain(what, f"{detail}\n{tail}", pid, ghost_limit=ghost_limit)
        if cause is not None:  # a cause the user can act on, CRIU's words kept in the tail
            raise CriuFailed(
                cause.message, errno=errno, log_tail=tail, log_path=str(log_path), pid=pid,
                hint=f"{cause.hint} (CRIU's log: {log_path})",
            )
        raise CriuFailed(
            f"CRIU {what} failed: {detail}", errno=errno, log_tail=tail,
            log_path=str(log_path), pid=pid, hint=f"see {log_path}",
        )


def _open_container(where: CriuPlacement, what: str, pid: int, gone_hint: str) -> Container:
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


def _run_started(
    started: Callable[[int], None], criu_pid: int, what: str, log_path: Path, pid: int | None
) -> None:
    try:
        started(criu_pid)
    except Exception as exc:
        log.exception("hook criu_started failed")
        raise CriuFailed(f"CRIU {what} aborted before it began: {exc}",
                         log_path=str(log_path), pid=pid, hint="") from exc


def _receive(sock: socket.socket) -> rpc_pb2.criu_resp | None:
    """One whole message, sized with MSG_PEEK|MSG_TRUNC. None when CRIU has gone."""
    try:
        size = _peek_size(sock)
        if size == 0:
            return None
        data = sock.recv(size)
    except (ConnectionResetError, BrokenPipeError):
        return None
    resp = rpc_pb2.criu_resp()
    resp.ParseFromString(data)
    return resp


def _peek_size(sock: socket.socket) -> int:
    buf = bytearray(1)
    nbytes, _, flags, _ = sock.recvmsg_into([buf], 0, socket.MSG_PEEK | socket.MSG_TRUNC)
    del flags
    return nbytes


def _is_harmless(line: str) -> bool:
    return any(h in line for h in _HARMLESS)


def log_tail_text(text: str, lines: int = 5) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    kept = [ln for ln in kept if not any(h in ln for h in _HARMLESS)]
    return " | ".join(kept[-lines:])


class _Abandoned(Exception):
    """Answers CRIU's post-dump notification with a failure: CRIU resumes the tree."""


class _SwrkDump:
    """One ``criu swrk`` dump, run in a thread and held at its post-dump notification (the
    ``CriuDumpInProgress`` port). Invariant: CRIU is answered exactly once at post-dump — go
    on (``finish``) or fail (``abort``, or the daemon's death closing the socket) — and on a
    failure CRIU itself resumes the tree and unlocks its network."""

    def __init__(self, criu: CriuSwrk, job: CriuDumpJob, hooks: CriuHooks) -> None:
        self._criu = criu
        self._job = job
        self._hooks = hooks
        self._started = time.monotonic()
        self._held = threading.Event()
        self._decided = threading.Event()
        self._proceed = False
        self._reached = False
        self._ended = False
        self._error: BaseException | None = None
        self._result: CriuDumpResult | None = None
        self._pids: tuple[int, ...] = ()
        self._tcp: tuple[TcpConnection, ...] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"criu-dump-{job.pid}", daemon=True
        )
        self._server: PageServer | None = None
        if job.page_sink is not None and job.container is None:
            self._server = PageServer(job.images_dir, job.page_sink,
                                      wire=wire_for(criu.status().version))

    @property
    def pids(self) -> tuple[int, ...]:
        return self._pids

    @property
    def holds_connections(self) -> bool:
        return self._job.tcp_established

    @property
    def tcp_sockets(self) -> tuple[TcpConnection, ...] | None:
        return self._tcp

    def start(self) -> None:
        """Run CRIU until it holds at post-dump; raises (the tree running) if it ends first."""
        self._thread.start()
        self._held.wait()
        if not self._reached:
            self._thread.join()
            self._ended = True
            if self._error is not None:
                raise self._error
            raise CriuFailed(f"CRIU dump of pid {self._job.pid} ended before its post-dump "
                             "notification", pid=self._job.pid)

    def finish(self) -> CriuDumpResult:
        if self._result is not None:
            return self._result
        if self._ended:
            raise CriuFailed(f"CRIU dump of pid {self._job.pid} was aborted", pid=self._job.pid)
        self._proceed = True
        self._decided.set()
        self._thread.join()
        self._ended = True
        if self._error is not None:
            raise self._error
        stats = read_dump_stats(self._job.work_dir)
        self._result = CriuDumpResult(
            frozen_s=(stats.frozen_time / 1e6) if stats else 0.0,
            freezing_s=(stats.freezing_time / 1e6) if stats else 0.0,
            pages_written=stats.pages_written if stats else 0,
            duration_s=time.monotonic() - self._started,
            pids=self._pids,
        )
        return self._result

    def abort(self) -> None:
        if self._ended:
            return
        self._proceed = False
        self._decided.set()
        self._thread.join()
        self._ended = True
        if self._error is not None and not isinstance(self._error.__cause__, _Abandoned):
            log.warning("CRIU dump of pid %d, abandoned: %s", self._job.pid, self._error)

    def _run(self) -> None:
        server = self._server
        try:
            if server is None:
                self._criu._run_dump(self._job, _HoldAtPostDump(self._hooks, self))
            else:  # CRIU sends its pages to the server; its end is closed here once passed
                server.start()
                job = replace(self._job, page_server_fd=server.criu_end().fileno())
                self._criu._run_dump(job, _HoldAtPostDump(self._hooks, self),
                                     started=lambda _pid: server.close_criu_end())
        except BaseException as exc:
            self._error = exc
        finally:
            if server is not None:
                server.close_criu_end()
                server.abort()  # a no-op once the session is over
                with contextlib.suppress(PageServerError):
                    server.wait(10)
            self._held.set()

    def held_at_post_dump(self) -> None:
        """In CRIU's conversation: the images are complete (CRIU ended its page-server
        session before this notification: the sink has had every page); wait for the
        decision."""
        if self._server is not None:
            self._server.wait(60)
        self._pids = read_pstree(self._job.images_dir)
        self._tcp = read_tcp_connections(self._job.images_dir)
        self._reached = True
        self._held.set()
        self._decided.wait()
        if not self._proceed:
            raise _Abandoned("the dump was abandoned (a later step failed)")


def _images_hold_connections(job: CriuRestoreJob) -> bool:
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


class _HoldAtPostDump(CriuHooks):
    """The caller's hooks, plus: hold at post-dump (after the caller's ``post_dump``)."""

    def __init__(self, inner: CriuHooks, dump: _SwrkDump) -> None:
        self._inner = inner
        self._dump = dump

    def pre_dump(self, pid: int) -> None:
        self._inner.pre_dump(pid)

    def network_lock(self, pid: int) -> None:
        self._inner.network_lock(pid)

    def post_dump(self, pid: int) -> None:
        self._inner.post_dump(pid)
        self._dump.held_at_post_dump()

    def network_unlock(self, pid: int) -> None:
        self._inner.network_unlock(pid)


class _DirFd:
    """A directory opened O_DIRECTORY for the lifetime of a ``with`` block."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY)
        return self.fd

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)
