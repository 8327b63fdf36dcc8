"""The composition root: the only place that picks adapters for the core's ports."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

from ckptd.adapters.clock import SystemClock
from ckptd.adapters.criu import CriuSwrk
from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.guard.client import PidfdTreeGuard
from ckptd.adapters.procfs import (
    LocalStdioProvider,
    ProcCudaFacts,
    ProcFsTable,
    ProcNodeInspector,
    RuntimeProbe,
    staging,
)
from ckptd.adapters.procfs.cgroups import CgroupFs
from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.adapters.procfs.threadhold import PtraceThreadHold
from ckptd.adapters.storage import (
    FileJournal,
    JsonPolicyRepo,
    LocalBlobStore,
    ObjectBlobStore,
    keyfile,
    open_blob_store,
)
from ckptd.adapters.storage.asidelog import FileAsideLog
from ckptd.core.config import CoreConfig
from ckptd.core.dump import DumpRecipe
from ckptd.core.gpu import GpuSteps
from ckptd.core.groups import GroupMembers
from ckptd.core.jobfiles import chunked_images
from ckptd.core.migrate import MigrateRecipe
from ckptd.core.parts import RecipeParts
from ckptd.core.policies import PolicyService
from ckptd.core.ports import BlobStore, GpuCheckpointer, GpuInventoryPort
from ckptd.core.receive import Receiver
from ckptd.core.restore import RestoreRecipe
from ckptd.core.service import CheckpointService
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.integrity import manifest_census
from ckptd.core.store.keys import ManifestKeys
from ckptd.daemon.config import DaemonConfig, compression_of
from ckptd.daemon.probe import NodeProbe
from ckptd.domain.model import ROOT
from ckptd.transport.grpc.peer import GrpcPeerConnector, TlsFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wired:
    service: CheckpointService
    store: ContentStore
    blobs: LocalBlobStore | ObjectBlobStore
    criu: CriuSwrk
    receiver: Receiver
    migrate: MigrateRecipe
    tls: TlsFiles | None
    policies: PolicyService
    groups: GroupMembers
    gpu: GpuSteps
    guard: PidfdTreeGuard
    cgroups: CgroupFs | None = None
    keys_created: bool = False
    """The manifest key file was created by this start (it adopts nothing by itself)."""
    fast_staging: staging.FastStaging | None = None
    """This daemon's RAM staging subdirectory, its lock held while the daemon lives."""


def tls_files(config: DaemonConfig) -> TlsFiles | None:
    """The TLS files between daemons, or None when none is configured. Raises ValueError
    when only some are."""
    given = {"tls_cert": config.tls_cert, "tls_key": config.tls_key, "tls_ca": config.tls_ca}
    if not any(given.values()):
        if config.peer_listen:
            raise ValueError("peer_listen needs tls_cert, tls_key and tls_ca")
        return None
    if missing := [k for k, v in given.items() if not v]:
        raise ValueError(f"{', '.join(missing)} not set (tls_cert, tls_key and tls_ca go "
                         "together)")
    return TlsFiles(Path(config.tls_cert), Path(config.tls_key), Path(config.tls_ca))


def gpu_adapters(
    config: DaemonConfig,
) -> tuple[GpuCheckpointer | None, GpuInventoryPort | None]:
    """The real GPU adapters, or (None, None) when GPU support is off. Importing them loads
    neither the bindings nor a driver: that happens at first use, and without them (not
    installed, no driver) the adapters say why (``ckptctl check``, the start-up log)."""
    if not config.gpu:
        return None, None
    try:
        from ckptd.adapters.cuda import CudaDriverCheckpointer
        from ckptd.adapters.nvml import NvmlInventory
    except ImportError:
        return None, None
    return CudaDriverCheckpointer(call_timeout_s=config.gpu_call_timeout_s), NvmlInventory()


def manifest_keys(config: DaemonConfig, blobs: BlobStore) -> tuple[ManifestKeys, bool]:
    """The node's manifest keys (``manifest_keys``), and whether this call created the file.

    Invariant: a key is created only for a store that holds no manifest signed with a key
    (format 2). A store that does was written with another key file, so the path is wrong (a
    mistyped ``--manifest-keys``, a wiped state dir): a new key would hide every checkpoint
    and sign what it writes with a key the other nodes lack. Raises ValueError (one line:
    what is wrong, what to do) then, and for a key file ``keyfile`` refuses."""
    path = Path(config.manifest_keys) if config.manifest_keys else (
        config.state_dir / "manifest.keys")
    keys = keyfile.load(path)
    if keys is not None:
        return keys, False
    census = manifest_census(blobs, held=())
    if census.foreign_count:
        raise ValueError(
            f"manifest key file {path} does not exist, but the store {config.store} holds "
            f"{census.foreign_count} manifest(s) signed with keys this node lacks "
            f"({census.foreign_keys()}): not creating a new key, which would hide them; "
            "point manifest_keys (--manifest-keys) at the key file they were signed with, or "
            "copy it here from another node of the cluster (install -m 600)"
        )
    keys, created = keyfile.create(path)
    if created:
        log.warning("created manifest key file %s (key %s): give every other node sharing "
                    "this store a copy before it starts", path, keys.signing_id)
    return keys, created


def _state_dirs(config: DaemonConfig) -> Path:
    """The state directory with its subdirectories (0700; output 0755: jobs write there)."""
    state = config.state_dir
    for sub in ("journal", "work", "output", "criu-plugins", "staging"):
        (state / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    (state / "output").chmod(0o755)
    return state


def core_config(config: DaemonConfig) -> CoreConfig:
    """What the core needs of the daemon's settings."""
    state = config.state_dir
    return CoreConfig(
        node=config.node or socket.gethostname(),
        daemon_pid=os.getpid(),
        work_dir=state / "work",
        output_dir=state / "output",
        zombie_wait_s=config.zombie_wait_s,
        file_capture_limit=config.file_capture_limit,
        file_capture_oversize=config.file_capture_oversize,
        tcp_outside_peers=config.tcp_outside_peers,
        shared_files=config.shared_files,
        ghost_limit=config.ghost_limit,
        ghost_total_limit=config.ghost_total_limit,
        files_dir_max_files=config.files_dir_max_files,
        ghost_uid_limit=config.ghost_uid_limit,
        aside_keep=config.aside_keep,
        aside_max_age_s=config.aside_max_age_s,
        jobs_cgroup=config.jobs_cgroup,
        stream_restore=config.stream_restore,
    )


def _open_store(
    config: DaemonConfig, clock: SystemClock, node: str,
) -> tuple[ContentStore, LocalBlobStore | ObjectBlobStore, bool, staging.FastStaging | None]:
    """The content store over the configured blob store, with this node's manifest keys;
    whether the key file was created now; this daemon's RAM staging (held while it lives).
    Raises ValueError (one line) for a staging directory that is not root's alone."""
    state = config.state_dir
    chunked = chunked_images(is_pages_image)
    blobs = open_blob_store(
        config.store,
        endpoint=config.store_endpoint or None,
        region=config.store_region or None,
        allow_http=config.store_allow_http or None,
    )
    if not isinstance(blobs, LocalBlobStore | ObjectBlobStore):  # pragma: no cover
        raise TypeError(f"unexpected blob store {type(blobs).__name__} for {config.store}")
    keys, keys_created = manifest_keys(config, blobs)
    # One daemon's staging must never be another's, nor a user's (adapters/procfs/staging):
    # its own unpredictable subdirectory, locked while it lives; dead daemons' are removed.
    fast = None
    if config.fast_staging_dir:
        tag = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]
        fast = staging.claim(config.fast_staging_dir, tag)
        for path in fast.removed:
            log.warning("removed the staging of a daemon no longer running: %s", path)
        for path in fast.left:
            log.warning("left alone in fast_staging_dir (not a directory of root's): %s", path)
    store = ContentStore(
        blobs,
        StagingPolicy(fast=fast.path if fast else None, disk=state / "staging"),
        clock=clock,
        is_pages_file=chunked,
        keys=keys,
        node=node,
        workers=config.compress_workers or (os.cpu_count() or 2),
        compression=compression_of(config),
        spill_ram=functools.partial(spill_ram_bytes, config.spill_ram_mib),
        gc_grace_s=config.gc_grace_s,
        stream_pages=config.stream_pages,
    )
    return store, blobs, keys_created, fast


def spill_ram_bytes(setting_mib: int) -> int:
    """A dump's RAM budget for its spill: ``spill_ram_mib`` in bytes, or with -1 a quarter of
    the memory available now (psutil: MemAvailable)."""
    if setting_mib >= 0:
        return setting_mib << 20
    return int(psutil.virtual_memory().available) // 4


def wire(config: DaemonConfig) -> Wired:
    state = _state_dirs(config)
    core = core_config(config)
    files = ProcJobFiles()
    clock = SystemClock()
    processes = ProcFsTable()
    cgroups = CgroupFs.find(config.cgroup_fs)
    if cgroups is None:
        log.warning("no cgroup v2 hierarchy found: restored trees go where CRIU puts them")
    criu = CriuSwrk(
        config.resolved_criu(),
        plugin_dir=state / "criu-plugins",
        log_level=config.criu_log_level,
        enter_preload=config.resolved_enter_preload(),
    )
    # what CRIU can do is asked once (a `criu check` each): now, not in the first restore
    threading.Thread(target=criu.warm_up, name="criu features", daemon=True).start()
    store, blobs, keys_created, fast = _open_store(config, clock, core.node)
    journal = FileJournal(state / "journal")
    guard = PidfdTreeGuard(state, state / "journal")
    gpu = GpuSteps(
        *gpu_adapters(config), clock, config.gpu_lock_timeout_ms,
        facts=ProcCudaFacts() if config.gpu else None,
        threads=PtraceThreadHold() if config.gpu else None,
    )
    parts = RecipeParts(
        criu=criu, processes=processes, store=store, journal=journal, clock=clock, config=core,
        gpu=gpu, node=ProcNodeInspector(), files=files, cgroups=cgroups,
        asides=FileAsideLog(state / "asides"),
    )
    dump = DumpRecipe(parts, guard=guard)
    restore = RestoreRecipe(parts, stdio=LocalStdioProvider(config.open_timeout_s))
    service = CheckpointService(
        dump=dump,
        restore=restore,
        store=store,
        processes=processes,
        journal=journal,
        clock=clock,
        config=core,
        probe=NodeProbe(criu, core.node, store.location, gpu, RuntimeProbe()),
        gpu=gpu,
        cgroups=cgroups,
    )
    receiver = Receiver(
        store=store,
        pages=store,
        check=restore.check,
        restore=lambda request, staged, received: service.restore(
            ROOT, request, staged=staged, received=received),
        clock=clock,
        node=core.node,
        session_ttl_s=config.peer_session_ttl_s,
        journal=journal,
    )
    tls = tls_files(config)
    migrate = MigrateRecipe(
        preview=dump.preview,
        dump=service.dump,
        restore_here=service.restore,
        pages=store,
        connector=GrpcPeerConnector(tls),
        clock=clock,
        events=service.events,
        journal=journal,
    )
    policies = PolicyService(
        dump=service.dump,
        restore=service.restore,
        repo=JsonPolicyRepo(state / "policies.json"),
        processes=processes,
        clock=clock,
        events=service.events,
        daemon_pid=os.getpid(),
    )
    return Wired(
        service=service, store=store, blobs=blobs, criu=criu, receiver=receiver,
        migrate=migrate, tls=tls, policies=policies,
        groups=GroupMembers(service.dump, store, service.restore), gpu=gpu, guard=guard,
        cgroups=cgroups, keys_created=keys_created, fast_staging=fast,
    )
