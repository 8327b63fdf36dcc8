"""Daemon configuration: one immutable value built from defaults, a TOML file and flags
(later ones win), then passed down. Nothing reads configuration from anywhere else."""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ckptd.adapters.storage.url import local_path
from ckptd.core.store.pagepath import CODECS, Compression
from ckptd.errors import BadRequest
from ckptd.transport import validate

GHOST_LIMIT_MAX = 0xFFFFFFFF
"""CRIU's ghost_limit is a uint32 of its RPC; a migration takes images of at most 4 GiB."""
DEFAULT_CRIU_PATHS = ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/bin/criu")
DEFAULT_ENTER_PRELOADS = (
    "/usr/lib/ckptd/ckptd_enter_mntns.so",
    str(Path(__file__).resolve().parents[2] / "native/enter-mntns/bin/ckptd_enter_mntns.so"),
)


@dataclass(frozen=True)
class DaemonConfig:
    socket: Path = Path("/run/ckptd/ckptd.sock")
    """Public gRPC socket (mode ``socket_mode``, group ``socket_group``)."""
    socket_mode: int = 0o660
    """Permission bits of the socket (octal in the TOML file, e.g. ``"660"``)."""
    socket_group: str = "ckptd"
    """Group allowed to use the socket; root only when the group does not exist."""
    store: str = "/var/lib/ckptd"
    """Where checkpoints live: a directory (or ``file:///dir``), or an object store URL
    (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``)."""
    store_endpoint: str = ""
    """Object store endpoint instead of the cloud's own (an S3-compatible server); empty: none."""
    store_region: str = ""
    """S3 region; empty: from the environment."""
    store_allow_http: bool = False
    """Allow a plain-HTTP ``store_endpoint``."""
    manifest_keys: str = ""
    """File of the keys that authenticate the store's manifests (HMAC-SHA256; one key a line,
    the first signs, all are accepted: rotation), kept outside the store: a regular file of
    root's, mode 0600 (anything else stops the start). Created with one fresh key if missing
    — unless the store already holds manifests signed by a key this node lacks: then the
    daemon does not start (a mistyped path or a wiped state dir). Every daemon sharing a store
    needs the same file. Empty: ``state_dir/manifest.keys``.
    docs/adr/0014-authenticated-manifests.md."""
    adopt_unauthenticated: bool = False
    """At start, sign every intact unauthenticated manifest (format 1: written before
    manifests were authenticated, by a ckptd that does not sign them — or planted by someone
    who can write the store) with this node's key, trusting the store as it is. Never done
    without it (not even when the key file is created): such manifests are not listed or
    restored, and the start-up log counts them. Set it for one start, after an upgrade."""
    state_dir: Path = Path("/var/lib/ckptd/state")
    """Journal of operations in flight, CRIU logs, restored jobs' output."""
    fast_staging_dir: str = "/run/ckptd/staging"
    """RAM-backed directory where CRIU writes a dump before it is ingested, when it fits
    (else ``state_dir/staging``). Root's alone: made root:root 0700 (no link followed on the
    way); every directory above it must be root's, and sticky where others may write it
    (``/dev/shm``), and one owned by anyone else — or a link anywhere — stops the start
    (ckptd/adapters/procfs/staging.py). The default lies under the runtime directory the
    systemd unit and the DaemonSet provide (a tmpfs). Each daemon uses its own subdirectory,
    with an unpredictable name, locked while it lives; at start, those of daemons no longer
    running are removed (only directories of root's). Empty: always on disk."""
    stream_pages: bool = True
    """CRIU sends a dump's pages to the daemon as it dumps (its page-server protocol), and they
    go into the store at once: the staging holds only the other images, and the memory the
    pages take is bounded (under 512 MiB) whatever the dump's size. Where ingest is slower
    than CRIU writing to RAM, the tree stays frozen until the pages beyond the receiver's pool
    are stored (docs/design/streaming.md has the figures). ``false``: CRIU writes the whole
    image to the staging first (RAM when it fits), ingested after the tree is thawed: a shorter
    freeze where RAM allows, for as much staging as the image."""
    spill_ram_mib: int = -1
    """How much of a streamed dump's spill (the pages CRIU sends faster than they are stored,
    kept until the tree is let go) may be held in RAM, in an anonymous memfd of the daemon's,
    before the rest goes to a file in the staging: -1 (default) a quarter of the memory
    available when the dump begins; 0 none. RAM keeps the freeze at CRIU's own copy where the
    staging is on a disk (docs/performance/profile.md); the memfd goes with the daemon if it
    dies."""
    stream_restore: bool = True
    """A restore's images go from the store to CRIU as they are read and verified (CRIU's
    image-streamer protocol), instead of being written into a directory first: no staging,
    memory bounded by a few frames per open image. Needs a CRIU with ckptd's patch
    (scripts/install-criu.sh; ``criu check --feature rpc_stream``); otherwise, and for
    restores into a container, the images are written first as before."""
    compression: str = "zstd"
    """Codec of new page frames: ``zstd`` or ``lz4`` (docs/performance/speed.md has the
    trade-off measured: LZ4 compresses ~3x and decompresses ~5x faster than zstd -1 and
    stores ~15% more bytes of real pages). A per-store choice: every node sharing a store
    reads frames of both codecs (a frame says which it is), whatever it writes — once every
    one of them runs a ckptd that knows LZ4 (an older one refuses those checkpoints, never
    restoring wrong data)."""
    compress_level: int = 1
    """The codec's level: zstd's (1: as ``zstd -1``; -1..-50: its ``--fast=N`` levels, faster,
    bigger), LZ4's (0-2: its default fast mode; negative: faster, bigger; 3-12: its slow HC
    levels)."""
    compress_workers: int = 0
    """Threads compressing frames; 0: one per CPU."""
    gc_interval_s: float = 3600.0
    """Collect unreferenced data this often (0: only on ``ckptctl gc``)."""
    gc_grace_s: float = 6 * 3600.0
    """How long GC keeps an unreferenced object after condemning it before deleting it (at
    least as long as any dump on any daemon sharing the store takes; default the lease TTL).
    0 deletes unreferenced data at once: only for a store no other daemon uses (tests)."""
    gpu: bool = True
    """Checkpoint CUDA processes through the driver (when NVML and cuda-python are present)."""
    gpu_lock_timeout_ms: int = 10000
    """How long a CUDA lock may wait for the process's running GPU work (0: no limit in the
    driver, the daemon's wait is still bounded by ``gpu_call_timeout_s``; negative: refused
    at start)."""
    gpu_call_timeout_s: float = 900.0
    """The longest the daemon waits for one CUDA checkpoint / restore / unlock call (a
    lock: its timeout plus a minute). Past it the call is reported failed and abandoned (it
    may still finish; the daemon goes on serving, that process is refused meanwhile)."""
    criu_path: str = ""
    """Empty: the first of DEFAULT_CRIU_PATHS that exists."""
    criu_log_level: int = 4
    """CRIU's log verbosity (its ``-v``, 0-4) for the logs kept in ``state_dir``."""
    criu_enter_preload: str = ""
    """native/enter-mntns's library, with which CRIU run inside a container (a job in one)
    is loaded from the node; empty: the first of DEFAULT_ENTER_PRELOADS that exists, else
    none (CRIU must then be in the container's root filesystem)."""
    zombie_wait_s: float = 5.0
    """How long a restore waits for a zombie holding a pid it needs to be reaped (and a
    rollback for a killed tree's tasks to go) before it refuses, naming the parent."""
    file_capture_limit: int = 8 << 30
    """Largest file a job writes whose content a checkpoint captures (bytes)."""
    file_capture_oversize: str = "refuse"
    """A file over ``file_capture_limit``: ``refuse`` the dump, or ``skip`` its capture."""
    files_dir_max_files: int = 10_000
    """Most regular files a dump captures under the job's output directories (``ckptctl run
    --files DIR``, each within ``file_capture_limit``): more refuses the dump in one line
    naming this setting (the job runs on), so that a DIR given one level too high (a home
    directory) is not copied into every checkpoint."""
    shared_files: str = "keep"
    """A file the job writes that a process outside the job also holds open for writing (or
    maps writable) when the job is restored — a log or history database shared with another
    program: ``keep`` leaves it as it is, never rolled back under that writer (the restore's
    outcome and event say so; refused when CRIU needs it at its checkpoint size and it is
    not: a file the job did not only append to), ``refuse`` refuses the restore naming that
    process's pid, ``roll-back`` puts the checkpoint's content back all the same (the
    version found kept aside, as for every file put back). ``check-restore`` and ``ckptctl
    show`` list such files and their writers."""
    tcp_outside_peers: str = "restore"
    """A job's TCP connection to a peer outside its tree: ``restore`` it established where
    the node has the connection's local address (else closed, the restore's event naming
    it), or ``refuse`` the dump (unless ``--tcp-close``)."""
    ghost_limit: int = 256 << 20
    """Largest ghost file a dump takes (bytes; CRIU's own limit is 1 MiB): a file the job
    holds open or mapped after deleting it — PyTorch's shared memory (DataLoader batches,
    tensors shared with torch.multiprocessing) is such files in /dev/shm — whose content
    CRIU copies into the checkpoint. A larger one refuses the dump, naming the file, its size
    and this setting. Each ghost file is staged (RAM when it fits) and read whole into the
    daemon's memory when the dump is stored: at most ``GHOST_LIMIT_MAX`` (4 GiB - 1, what
    CRIU's RPC and a migration's images allow)."""
    ghost_total_limit: int = 1 << 30
    """Largest total of the ghost files one dump takes (bytes, each also within
    ``ghost_limit``): they are all staged at once (RAM when they fit: RAM every tenant's
    DataLoader and NCCL share). A dump over it is refused before anything is frozen, in one
    line naming the files, their total and this setting. The bytes counted are the files'
    allocated ones (what CRIU copies); they count in the choice of RAM or disk staging."""
    ghost_uid_limit: int = 4 << 30
    """Largest total of ghost files of the dumps of one uid's trees that this daemon runs at
    once (bytes): a dump that would take that uid's over it is refused before anything is
    frozen, naming this setting (a group checkpoint's members count together)."""
    aside_keep: int = 3
    """Copies a restore keeps aside of each file it puts back (``<path>.ckptd-<restore id>``):
    after a restore that succeeds, the oldest beyond this many are removed (at least 1)."""
    aside_max_age_s: float = 7 * 86400
    """...and those older than this (seconds; 0: no age limit). ``ckptctl asides`` lists them
    and removes them on request."""
    max_workers: int = 16
    """Threads serving calls on the local API (and, apart, on the peer listener)."""
    max_connections_per_uid: int = 64
    """Connections to the local socket one uid other than root may hold at once; more are
    closed as they come (root's never are)."""
    max_connections: int = 512
    """Connections of all uids but root together."""
    max_calls_per_uid: int = 8
    """Calls in progress one uid other than root may have (a dump's or restore's progress
    stream counts until it ends; an open stream such as ``events --follow`` does not: see
    ``max_open_streams_per_uid``); more are refused at once (RESOURCE_EXHAUSTED)."""
    max_user_calls: int = 12
    """Calls in progress of all uids but root together: below ``max_workers``, so that
    ``max_workers - max_user_calls`` workers always serve root."""
    max_operations_per_uid: int = 2
    """Dumps, restores and migrations one uid other than root may run at once."""
    max_open_streams_per_uid: int = 4
    """Streams that stay open as long as their client likes (``ckptctl events --follow``,
    health Watch, reflection) one uid other than root may hold; they take no call slot, so
    idle ones never block anyone's calls. More are refused at once (RESOURCE_EXHAUSTED)."""
    max_user_open_streams: int = 8
    """Such streams of all uids but root together; the local API has this many workers more
    than ``max_workers`` to serve them."""
    max_streams_per_connection: int = 16
    """HTTP/2 streams (calls queued or running) per connection: with the connection limit,
    it bounds the work a uid may queue."""
    max_queued_calls: int = 1024
    """Calls the server holds at once, queued or running (beyond: RESOURCE_EXHAUSTED)."""
    open_timeout_s: float = 10.0
    """How long opening a file for a caller (``restore --output``) may take (a slow or hung
    file system) before the request fails; such opens never hold a worker longer."""
    shutdown_grace_s: float = 60.0
    """On SIGTERM: how long calls still running may take to finish, before the daemon waits
    ``shutdown_grace_s + gpu_call_timeout_s`` more for a dump or restore under way."""
    log_level: str = "INFO"
    """The daemon's log level (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``); it logs one JSON
    object per line on stderr."""
    node: str = ""
    """Empty: the host name."""
    peer_listen: str = ""
    """``host:port`` where other daemons reach this one (gRPC, mutual TLS) to migrate jobs
    here. Empty (default): no TCP listener at all."""
    tls_cert: str = ""
    """This node's certificate (PEM), used as server and as client between daemons; its
    subject alternative names must hold the address other daemons dial."""
    tls_key: str = ""
    """This node's private key (PEM) for ``tls_cert``."""
    tls_ca: str = ""
    """The CA certificate (PEM) that signs every daemon's certificate; nothing else is
    accepted, in either direction."""
    peer_session_ttl_s: float = 600.0
    """A migration into this node idle this long (its sender gone) is dropped."""
    metrics_listen: str = ""
    """``host:port`` of the Prometheus endpoint (plain HTTP, no authentication: bind it to a
    private address). Empty (default): no endpoint."""
    spot_providers: str = ""
    """Clouds whose spot/preemption notice to watch, comma-separated: ``aws``, ``gcp``,
    ``azure``. On a notice every protected job is checkpointed and stopped. Empty: off."""
    spot_aws_url: str = ""
    """Instead of AWS's instance-metadata spot/instance-action URL (tests, proxies)."""
    spot_gcp_url: str = ""
    """Instead of GCP's metadata ``instance/preempted`` URL (tests, proxies)."""
    spot_azure_url: str = ""
    """Instead of Azure's Scheduled Events URL (tests, proxies)."""
    spot_poll_s: float = 5.0
    """How often the spot notice URLs are polled (seconds)."""
    policy_tick_s: float = 1.0
    """How often periodic policies are looked at."""
    resume_drained_on_start: bool = False
    """At start, restore every job a drain (or a spot notice) checkpointed and stopped."""
    jobs_cgroup: str = "/ckptd-jobs"
    """cgroup v2 path under which a tree the daemon restores for itself (resume, migration
    target) or for a caller in its own cgroup gets a cgroup of its own, outside the daemon's;
    empty: such trees stay in the daemon's cgroup. Other callers' restores go into theirs."""
    cgroup_fs: str = ""
    """Mount point of the cgroup v2 hierarchy (its root); empty: found in
    /proc/self/mountinfo. No cgroup v2: restored trees are not placed (CRIU's default)."""

    @property
    def run_dir(self) -> Path:
        return self.socket.parent

    def resolved_criu(self) -> str:
        if self.criu_path:
            return self.criu_path
        for cand in DEFAULT_CRIU_PATHS:
            if Path(cand).exists():
                return cand
        return DEFAULT_CRIU_PATHS[0]

    def resolved_enter_preload(self) -> Path | None:
        if self.criu_enter_preload:
            return Path(self.criu_enter_preload)
        return next((Path(c) for c in DEFAULT_ENTER_PRELOADS if Path(c).is_file()), None)


_PATHS = {"socket", "state_dir"}
DEFAULT_URL_STATE_DIR = Path("/var/lib/ckptd/state")
"""The state directory when the store is an object store URL and none is given."""


def operations_wait_s(config: DaemonConfig) -> float:
    """How long a stopping daemon waits for dumps and restores still under way, once its RPCs
    are done: ``shutdown_grace_s`` plus ``gpu_call_timeout_s``, so that an operation inside a
    CUDA driver call (a checkpoint of a big model) is not cut mid-call (issue 23)."""
    return config.shutdown_grace_s + config.gpu_call_timeout_s


def stop_bound_s(config: DaemonConfig) -> float:
    """The longest a stop (SIGTERM) takes: running RPCs (``shutdown_grace_s``), a migrated
    checkpoint's commit (as long), then ``operations_wait_s``. systemd's ``TimeoutStopSec``
    and the DaemonSet's ``terminationGracePeriodSeconds`` must exceed it (with the
    defaults: 1080 s; they say 1200), else the daemon is killed inside a driver call
    (tests/unit/test_deploy_files.py checks the relation)."""
    return 2 * config.shutdown_grace_s + operations_wait_s(config)


def _coerce(name: str, value: Any) -> Any:
    if name in _PATHS:
        return Path(value)
    if name == "store":
        return str(value)
    if name == "socket_mode" and isinstance(value, str):
        return int(value, 8)
    return value


def load(args: argparse.Namespace) -> DaemonConfig:
    """Defaults, overlaid by ``--config FILE`` (TOML, keys as the fields), then by flags."""
    config = DaemonConfig()
    known = {f.name for f in fields(DaemonConfig)}
    if args.config:
        data = tomllib.loads(Path(args.config).read_text())
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown setting(s) in {args.config}: {', '.join(sorted(unknown))}"
            )
        config = replace(config, **{k: _coerce(k, v) for k, v in data.items()})
    overrides = {
        k: _coerce(k, v) for k, v in vars(args).items() if k in known and v is not None
    }
    config = replace(config, **overrides)
    _check_jobs_cgroup(config.jobs_cgroup)
    _check_limits(config)
    if args.store is not None and args.state_dir is None and not _in_file(args, "state_dir"):
        local = local_path(config.store)
        state = DEFAULT_URL_STATE_DIR if local is None else local / "state"
        config = replace(config, state_dir=state)
    return config


def _check_jobs_cgroup(path: str) -> None:
    parts = [p for p in path.split("/") if p]
    if path and (not path.startswith("/") or not parts or ".." in parts or "." in parts):
        raise ValueError(f"jobs_cgroup {path!r} must be a cgroup path below the root, such as "
                         "/ckptd-jobs (or empty)")


def compression_of(config: DaemonConfig) -> Compression:
    """``compression`` and ``compress_level`` as the store's value (ValueError naming both
    settings when they make no sense)."""
    codec = config.compression
    try:
        if codec not in CODECS:
            raise ValueError(f"must be one of {', '.join(CODECS)}")
        return Compression(codec, config.compress_level)
    except ValueError as exc:
        raise ValueError(f"compression {codec!r} with compress_level {config.compress_level!r}: "
                         f"{exc}") from exc


def _check_limits(config: DaemonConfig) -> None:
    """Listen addresses and limits make sense (ValueError naming the setting otherwise)."""
    compression_of(config)
    if not isinstance(config.spill_ram_mib, int) or config.spill_ram_mib < -1:
        raise ValueError(f"spill_ram_mib {config.spill_ram_mib!r} must be a whole number of "
                         "MiB, 0 (none in RAM) or -1 (a quarter of the available memory)")
    for key in ("peer_listen", "metrics_listen"):
        value = getattr(config, key)
        if value:
            try:
                validate.address(value, key, listen=True)
            except BadRequest as exc:
                raise ValueError(str(exc)) from exc
    for key in ("max_workers", "max_connections_per_uid", "max_connections",
                "max_calls_per_uid", "max_user_calls", "max_operations_per_uid",
                "max_open_streams_per_uid", "max_user_open_streams",
                "max_streams_per_connection", "max_queued_calls"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} {value!r} must be a whole number of at least 1")
    if config.max_user_calls >= config.max_workers:
        raise ValueError(f"max_user_calls ({config.max_user_calls}) must be below max_workers "
                         f"({config.max_workers}): some workers must stay free for root")
    lock = config.gpu_lock_timeout_ms
    if isinstance(lock, bool) or not isinstance(lock, int) or not 0 <= lock <= 0xFFFFFFFF:
        raise ValueError(f"gpu_lock_timeout_ms {lock!r} must be a whole number of ms, "
                         "0 (no limit) or more")
    if not 0 < config.gpu_call_timeout_s <= 86400:
        raise ValueError(f"gpu_call_timeout_s {config.gpu_call_timeout_s!r} must be in "
                         "(0, 86400]")
    ghost = config.ghost_limit
    if isinstance(ghost, bool) or not isinstance(ghost, int) or not 0 <= ghost <= GHOST_LIMIT_MAX:
        raise ValueError(f"ghost_limit {ghost!r} must be a whole number of bytes from 0 (no "
                         f"ghost files) to {GHOST_LIMIT_MAX} (4 GiB - 1)")
    files_max = config.files_dir_max_files
    if isinstance(files_max, bool) or not isinstance(files_max, int) or files_max < 0:
        raise ValueError(f"files_dir_max_files {files_max!r} must be a whole number of files, "
                         "0 or more")
    for key in ("ghost_total_limit", "ghost_uid_limit"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
            raise ValueError(f"{key} {value!r} must be a whole number of bytes, 0 (no ghost "
                             "files) or more")
    if isinstance(config.aside_keep, bool) or not isinstance(config.aside_keep, int) \
            or config.aside_keep < 1:
        raise ValueError(f"aside_keep {config.aside_keep!r} must be a whole number of at "
                         "least 1 (the copy the last restore kept)")
    if not 0 <= config.aside_max_age_s <= 10 * 365 * 86400:
        raise ValueError(f"aside_max_age_s {config.aside_max_age_s!r} must be in [0, 10 "
                         "years] seconds (0: no age limit)")
    if not 0 < config.open_timeout_s <= 3600:
        raise ValueError(f"open_timeout_s {config.open_timeout_s!r} must be in (0, 3600]")
    if config.shared_files not in ("keep", "refuse", "roll-back"):
        raise ValueError(f"shared_files {config.shared_files!r} must be \"keep\", "
                         "\"refuse\" or \"roll-back\"")
    if config.tcp_outside_peers not in ("restore", "refuse"):
        raise ValueError(f"tcp_outside_peers {config.tcp_outside_peers!r} must be \"restore\" "
                         "or \"refuse\"")


def _in_file(args: argparse.Namespace, key: str) -> bool:
    if not args.config:
        return False
    return key in tomllib.loads(Path(args.config).read_text())
