"""``ckptd``: the daemon's entry point and lifecycle.

Start: take the state-directory lock (one daemon per state dir), wait for the guard of a killed
predecessor to finish (docs/adr/0016), recover what it left in flight, start this daemon's
guard, serve gRPC (health and reflection on), tell systemd READY=1.
SIGTERM/SIGINT: tell systemd STOPPING=1, stop accepting, let running calls finish (up to
``shutdown_grace_s``), then running operations (``config.operations_wait_s``: as long again
plus ``gpu_call_timeout_s``), exit 0. Processes the daemon restored are not its children and
are never touched by its exit.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import grp
import hashlib
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ckptd import __version__
from ckptd._gen.ckptd.v1 import ckptd_pb2, ckptd_pb2_grpc
from ckptd.adapters.cloud.spot import sources_from
from ckptd.adapters.guard.client import wait_for_guards
from ckptd.core.store.cas import ContentStore
from ckptd.daemon import heap, logs, sdnotify
from ckptd.daemon.background import Background
from ckptd.daemon.config import DaemonConfig, load, operations_wait_s
from ckptd.daemon.probe import gpu_summary
from ckptd.daemon.statedir import StateDirUnusable, open_lock, open_state_dir
from ckptd.daemon.wiring import Wired, tls_files, wire
from ckptd.domain.model import ROOT
from ckptd.errors import CkptdError
from ckptd.transport.grpc.limits import CallLimits, LimitInterceptor, Limits
from ckptd.transport.grpc.peer import CHANNEL_OPTIONS, serve_peer
from ckptd.transport.grpc.peercred import ConnectionLimits, PeerCredProxy
from ckptd.transport.grpc.servicer import CheckpointerServicer

log = logging.getLogger("ckptd")
SERVICE_NAME = ckptd_pb2.DESCRIPTOR.services_by_name["Checkpointer"].full_name


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The daemon's flags (each the ``DaemonConfig`` field of its ``dest``); the manual's
    reference (docs/reference/ckptd.md) is generated from it."""
    p = argparse.ArgumentParser(prog="ckptd", description="ckptd checkpoint/restore daemon")
    p.add_argument("--config", help="TOML file with settings (keys as the long flags, '_')")
    p.add_argument("--socket", help="gRPC Unix socket (default /run/ckptd/ckptd.sock)")
    p.add_argument(
        "--store",
        help="checkpoint store: a directory or file:///path (local, NFS), s3://bucket/prefix, "
        "gs://bucket/prefix, az://container/prefix (default /var/lib/ckptd)",
    )
    p.add_argument("--store-endpoint", dest="store_endpoint",
                   help="object store endpoint URL (S3-compatible servers)")
    p.add_argument("--store-region", dest="store_region", help="object store region")
    p.add_argument("--store-allow-http", dest="store_allow_http", action="store_true",
                   default=None, help="allow plain-HTTP endpoints (test servers only)")
    p.add_argument("--state-dir", dest="state_dir", help="journal, logs (default STORE/state)")
    p.add_argument("--manifest-keys", dest="manifest_keys",
                   help="file of the keys authenticating manifests, the same on every node "
                        "of a shared store (default STATE_DIR/manifest.keys; created 0600 "
                        "unless the store holds manifests signed by another key)")
    p.add_argument("--adopt-unauthenticated", dest="adopt_unauthenticated",
                   action="store_true", default=None,
                   help="sign the store's unauthenticated (format 1) manifests with this "
                        "node's key at start, trusting the store as it is (once, after an "
                        "upgrade)")
    p.add_argument("--criu", dest="criu_path", help="path of the criu binary")
    p.add_argument("--socket-group", dest="socket_group", help="group allowed on the socket")
    p.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--peer-listen", dest="peer_listen",
                   help="host:port for other daemons (migration; mutual TLS; default off)")
    p.add_argument("--tls-cert", dest="tls_cert", help="this node's certificate (PEM)")
    p.add_argument("--tls-key", dest="tls_key", help="this node's private key (PEM)")
    p.add_argument("--tls-ca", dest="tls_ca", help="CA certificate every daemon's is signed by")
    p.add_argument("--metrics-listen", dest="metrics_listen",
                   help="host:port of the Prometheus /metrics endpoint (default off)")
    p.add_argument("--spot-providers", dest="spot_providers",
                   help="watch these clouds' spot notices: aws,gcp,azure (default off)")
    p.add_argument("--file-capture-limit", dest="file_capture_limit", type=int,
                   help="largest file a job writes that a checkpoint captures, in bytes")
    p.add_argument("--file-capture-oversize", dest="file_capture_oversize",
                   choices=("refuse", "skip"),
                   help="a written file over the limit: refuse the dump (default) or skip it")
    p.add_argument("--jobs-cgroup", dest="jobs_cgroup",
                   help="cgroup v2 path for trees the daemon restores for itself "
                        "(default /ckptd-jobs; '' keeps them in the daemon's cgroup)")
    p.add_argument("--cgroup-fs", dest="cgroup_fs",
                   help="mount point of the host's cgroup v2 hierarchy (default: found)")
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load(args)
        if len(str(config.socket)) > SUN_PATH_MAX:
            raise ValueError(
                f"socket path {config.socket} is {len(str(config.socket))} bytes, more than a "
                f"Unix socket takes ({SUN_PATH_MAX}); choose a shorter --socket"
            )
        tls_files(config)
        sources_from([p.strip() for p in config.spot_providers.split(",") if p.strip()], {})
    except (OSError, ValueError) as exc:
        print(f"ckptd: bad configuration: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level)
    if os.geteuid() != 0:
        print("ckptd: must run as root (CRIU needs it); try: sudo ckptd", file=sys.stderr)
        return 2
    heap.limit_arenas(heap.ARENA_MAX)  # before any thread of the daemon's
    return Daemon(config).run()


def _check_store(cfg: DaemonConfig, store: ContentStore) -> None:
    """Log what the index found damaged when it was built (every pack's footer and trailer),
    adopt unauthenticated manifests when asked to (never otherwise), and count the store's
    manifests by key: those signed with keys this node lacks, those left unadopted."""
    check = store.startup_check()
    for line in check.lines():
        log.error("%s", line)
    (log.warning if check.damaged else log.info)("%s", check.summary())
    if cfg.adopt_unauthenticated:
        adoption = store.adopt_unauthenticated()
        log.warning("adopt_unauthenticated: signed %d manifest(s) written before manifests "
                    "were authenticated%s", len(adoption.adopted),
                    f": {', '.join(adoption.adopted)}" if adoption.adopted else "")
        for line in adoption.refused:
            log.error("not adopted: %s", line)
    census = store.manifest_census()
    (log.warning if census.foreign else log.info)("%s", census.summary())
    if census.legacy and not cfg.adopt_unauthenticated:
        log.warning("%s", census.unadopted())


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._stop = threading.Event()

    def _lock_state_dir(self) -> int | None:
        """The state dir's lock (None: another daemon holds it), once the directory is
        checked and tightened (``statedir``); raises ``StateDirUnusable``."""
        dir_fd = open_state_dir(self.config.state_dir, os.geteuid())
        try:
            fd = open_lock(dir_fd, self.config.state_dir)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def _serve_peers(self, wired: Wired) -> grpc.Server | None:
        """The TCP listener for other daemons (Peer service only, mutual TLS), if configured."""
        cfg = self.config
        if not cfg.peer_listen:
            return None
        assert wired.tls is not None  # tls_files() refused the configuration otherwise
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="peer"),
            options=CHANNEL_OPTIONS,
        )
        port = serve_peer(server, wired.receiver, cfg.peer_listen, wired.tls, wired.groups)
        server.start()
        log.info("peer listener (mutual TLS) on %s, port %d", cfg.peer_listen, port)
        return server

    def _start_up(self, wired: Wired) -> None:
        """Before serving: a killed daemon's operations recovered (its migrations in doubt
        settled in the background, ``core.settle``), the guard started, what ended trees and
        crashes left removed; CRIU and the GPUs said in the log."""
        cfg = self.config
        for line in wired.service.recover():
            log.warning("recovered: %s", line)
        wired.guard.start()
        # migrations in doubt: their targets asked in the background (a start never waits)
        wired.migrate.settler.settle_later(wired.service.unsettled)
        if wired.cgroups is not None and cfg.jobs_cgroup:
            wired.cgroups.remove_empty(cfg.jobs_cgroup)  # trees restored earlier have ended
        for leftover in wired.store.clean():
            log.warning("removed leftover %s", leftover)
        if removed := wired.blobs.remove_temporaries():
            log.warning("removed %d partial object(s) a crash left in the store", removed)
        criu = wired.criu.status()
        if criu.ok:
            log.info("using CRIU %s at %s", criu.version, criu.path)
        else:
            log.error("CRIU unusable, dumps will be refused: %s", criu.message)
        log.info("GPU: %s", gpu_summary(wired.gpu))

    def _serve_callers(self, wired: Wired, inner: Path, peers: Path,
                       ) -> tuple[grpc.Server, health.HealthServicer]:
        """The gRPC server of the Checkpointer service (and health, reflection) on the
        relay's inner socket, with the per-caller limits; started."""
        cfg = self.config
        limits = CallLimits(Limits(per_uid=cfg.max_calls_per_uid,
                                   operations_per_uid=cfg.max_operations_per_uid,
                                   shared=cfg.max_user_calls,
                                   open_streams_per_uid=cfg.max_open_streams_per_uid,
                                   shared_open_streams=cfg.max_user_open_streams))
        server = grpc.server(  # users' open streams have workers of their own
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers + cfg.max_user_open_streams,
                                       thread_name_prefix="rpc"),
            interceptors=(LimitInterceptor(limits, peers),),
            options=(("grpc.max_concurrent_streams", cfg.max_streams_per_connection),),
            maximum_concurrent_rpcs=cfg.max_queued_calls,
        )
        ckptd_pb2_grpc.add_CheckpointerServicer_to_server(  # type: ignore[no-untyped-call]
            CheckpointerServicer(wired.service, peers, wired.migrate, wired.policies,
                                 wired.groups, wired.receiver.node, limits,
                                 after_operation=heap.trim),
            server,
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        server.add_insecure_port(f"unix:{inner}")
        server.start()
        return server, health_servicer

    def _shut_down(self, wired: Wired, health_servicer: health.HealthServicer,
                   background: Background, proxy: PeerCredProxy,
                   peer_server: grpc.Server | None, server: grpc.Server) -> None:
        """Stop accepting, let calls and operations finish (bounded: ``shutdown_grace_s``,
        then ``operations_wait_s``), never cutting a dump half-way."""
        cfg = self.config
        log.info("stopping: waiting up to %.0fs for running operations", cfg.shutdown_grace_s)
        sdnotify.notify("STOPPING=1")
        health_servicer.enter_graceful_shutdown()
        wired.service.close()
        background.stop()
        proxy.stop()
        if peer_server is not None:
            peer_server.stop(cfg.shutdown_grace_s)
        server.stop(cfg.shutdown_grace_s).wait()
        # An RPC cut by the grace period does not stop its operation: let it finish, so that
        # no tree is left stopped or CUDA-checkpointed by a daemon that went away.
        if not wired.receiver.wait_commits(cfg.shutdown_grace_s):
            log.error("stopping with a migrated checkpoint still being committed (its staging "
                      "is dropped at the next start; the sender keeps the checkpoint)")
        # as long again plus a driver call's bound: never cut inside a CUDA call (issue 23)
        if left := wired.service.wait_idle(operations_wait_s(cfg)):
            log.error("stopping with operations still running: %s (the next start recovers "
                      "them from the journal)", ", ".join(left))

    def run(self) -> int:
        cfg = self.config
        try:
            lock_fd = self._lock_state_dir()
        except StateDirUnusable as exc:
            print(f"ckptd: {exc}", file=sys.stderr)
            return 2
        if lock_fd is None:
            print(
                f"ckptd: another ckptd is running with state dir {cfg.state_dir}; stop it first",
                file=sys.stderr,
            )
            return 1
        if not wait_for_guards(cfg.state_dir, GUARD_WAIT_S):
            log.error("the guard of the previous daemon still runs after %.0fs; recovering "
                      "anyway", GUARD_WAIT_S)
        try:
            wired = wire(cfg)
        except ValueError as exc:  # a manifest key file refused
            print(f"ckptd: {exc}", file=sys.stderr)
            os.close(lock_fd)
            return 2
        _check_store(cfg, wired.store)
        self._start_up(wired)

        inner, peers = _socket_dirs(cfg)
        server, health_servicer = self._serve_callers(wired, inner, peers)
        _raise_fd_limit(3 * (cfg.max_connections + cfg.max_connections_per_uid) + 1024)
        proxy = PeerCredProxy(cfg.socket, inner, peers, cfg.socket_mode, _group_id(cfg),
                              ConnectionLimits(per_uid=cfg.max_connections_per_uid,
                                               total=cfg.max_connections))
        proxy.start()
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        background = Background(cfg, wired)
        try:
            peer_server = self._serve_peers(wired)
            background.start_metrics()
        except (CkptdError, OSError, ValueError) as exc:
            print(f"ckptd: cannot listen: {exc}", file=sys.stderr)
            proxy.stop()
            server.stop(0)
            os.close(lock_fd)
            return 2

        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        log.info("ckptd %s serving on %s, store %s", __version__, cfg.socket, cfg.store)
        sdnotify.notify(f"READY=1\nSTATUS=serving on {cfg.socket}\nMAINPID={os.getpid()}")
        background.start()
        if cfg.resume_drained_on_start:
            threading.Thread(target=_resume_drained, args=(wired,), name="resume",
                             daemon=True).start()
        while not self._stop.wait(1.0):
            pass

        self._shut_down(wired, health_servicer, background, proxy, peer_server, server)
        if wired.fast_staging is not None:  # its own RAM staging goes with a clean stop
            wired.fast_staging.release()
        with contextlib.suppress(FileNotFoundError):
            inner.unlink()
        os.close(lock_fd)
        log.info("stopped")
        return 0


GUARD_WAIT_S = 30.0
"""How long a starting daemon waits for its predecessor's guard (it waits at most
``core.guard.TRACED_WAIT_S`` for a CRIU, then acts and exits)."""

SUN_PATH_MAX = 107
"""Longest Unix socket path the kernel takes (sun_path is 108 bytes with the NUL)."""


def _socket_dirs(cfg: DaemonConfig) -> tuple[Path, Path]:
    """The relay's inner socket path and the per-caller socket directory, their directories
    made (0700) and emptied of stale sockets."""
    private = _private_dir(cfg)
    peers = private / "peers"
    cfg.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    for d in (private, peers):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
        for stale in d.glob("*"):
            if stale.is_socket():
                stale.unlink()
    inner = private / "grpc.sock"
    return inner, peers


def _private_dir(cfg: DaemonConfig) -> Path:
    """Where the relay's inner socket and per-caller sockets live: one directory per public
    socket (two daemons may share a run directory), with paths short enough for sun_path
    whatever the public socket's directory: under /run when that is ours to use."""
    tag = hashlib.sha256(str(cfg.socket.resolve()).encode()).hexdigest()[:12]
    beside = cfg.run_dir / f".{cfg.socket.name}.private"
    longest = len(str(beside / "peers" / "4294967295-4194304-999999"))
    if longest <= SUN_PATH_MAX:
        return beside
    return Path("/run") / f"ckptd-{tag}"


def _resume_drained(wired: Wired) -> None:
    """``resume_drained_on_start``: restore what a drain or spot notice stopped."""
    try:
        resumed, errors = wired.policies.resume(ROOT)
    except Exception:
        log.exception("resuming drained jobs failed")
        return
    for outcome in resumed:
        log.info("resumed drained job from %s as pid %d", outcome.checkpoint_id, outcome.pid)
    for error in errors:
        log.error("could not resume a drained job: %s", error)


def _raise_fd_limit(needed: int) -> None:
    """Let the daemon hold ``needed`` fds (3 per relayed connection: both relay sides and
    the gRPC server's), within the hard limit; the limits on connections keep it there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the fd limit to %d (%s); a connection flood may reach "
                        "it", want, exc)


def _group_id(cfg: DaemonConfig) -> int:
    try:
        return grp.getgrnam(cfg.socket_group).gr_gid
    except KeyError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
