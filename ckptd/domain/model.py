"""Value types shared by every layer. All are frozen: a value, once made, never changes."""

from __future__ import annotations

import enum
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# re-exported: the form lives in ckptd.textforms, which the CLI imports without the domain
from ckptd.textforms import is_checkpoint_id as is_checkpoint_id  # noqa: PLC0414


def new_checkpoint_id(now: float) -> str:
    """A new checkpoint id: ``ck-<UTC time>-<6 hex>``; sorts by creation time, never all digits
    (so a CLI argument is unambiguously a pid or an id)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"ck-{stamp}-{secrets.token_hex(3)}"


CALLER_GONE = -1
"""``Caller.start_time`` of a caller whose process had exited when its connection was taken:
nothing may be decided from its pid."""


@dataclass(frozen=True)
class Caller:
    """Who asked, as the kernel says (SO_PEERCRED). ``uid`` 0 may act on any process.

    Invariant: ``pid`` alone never names the caller's process (a pid is reused once its
    process is reaped); with ``start_time`` it does. Whatever is decided from the caller's
    process (its cgroup, its container, its pid namespace) is decided only while a process
    with that pid AND that start time is alive (``core.callers.caller_process``)."""

    uid: int
    pid: int | None = None
    start_time: int = 0
    """When the calling process started (clock ticks since boot), as the relay read it while
    holding a pidfd on the process that connected (ADR 0001); ``CALLER_GONE`` when that
    process had exited already; 0: not pinned (a caller made inside the daemon)."""

    @property
    def is_root(self) -> bool:
        return self.uid == 0


ROOT = Caller(uid=0)


class PidState(enum.Enum):
    FREE = "free"
    RUNNING = "running"  # any live state: running, sleeping, disk wait
    STOPPED = "stopped"  # job-control or ptrace stop
    ZOMBIE = "zombie"


@dataclass(frozen=True)
class PidStatus:
    """What occupies a pid now. ``ppid``/``comm`` are set unless the pid is free."""

    pid: int
    state: PidState
    ppid: int = 0
    comm: str = ""
    uid: int = 0
    kernel_thread: bool = False
    traced: bool = False
    """Under ptrace (CRIU holds it while it dumps or restores)."""
    tracer: int = 0
    """The pid of its tracer (TracerPid; 0: none or unknown)."""
    tgid: int = 0
    """Its thread group (Tgid): its process's pid; another value than ``pid`` means ``pid``
    names a thread of process ``tgid``. 0: unknown."""
    session: int = -1
    """Session id as this pid namespace sees it; 0 when the session leader is outside the
    namespace (a launcher that never called setsid), -1 when unknown."""
    start_time: int = 0
    """When the process started (clock ticks since boot; 0 when unknown): with the pid, it
    names one process (a pid alone may be reused)."""
    ns_pids: tuple[int, ...] = ()
    """The process's pid in each pid namespace from the daemon's down to its own (NSpid):
    ``(pid,)`` in the daemon's namespace, ``(pid, 1)`` for the init of a namespace of its
    own; empty when unknown."""


@dataclass(frozen=True)
class ProcessFact:
    pid: int
    ppid: int
    comm: str
    cmdline: tuple[str, ...]
    uid: int
    gid: int
    threads: int = 1
    rss: int = 0
    start_time: int = 0
    """Clock ticks since boot (0: unknown); with ``pid`` it names one process."""
    ns_pid: int = 0
    """Its pid in the pid namespace of the tree's root (what CRIU's images hold and what a
    restore recreates); 0 means the same as ``pid`` (the tree shares the daemon's)."""

    @property
    def image_pid(self) -> int:
        """The pid CRIU's images know this process by."""
        return self.ns_pid or self.pid


@dataclass(frozen=True)
class TcpConnection:
    """A connected TCP socket of a process of a tree (``local``/``remote``: ``ip:port``)."""

    pid: int
    comm: str
    local: str
    remote: str
    state: str
    inode: int


class StdioKind(enum.StrEnum):
    PIPE = "pipe"
    TTY = "tty"
    FILE = "file"
    DEVNULL = "devnull"
    SOCKET = "socket"
    OTHER = "other"


@dataclass(frozen=True)
class StdioFact:
    """A file descriptor 0-2 of a process in the tree, and what a restore does with it.

    ``external_key`` is CRIU's name for the resource when the tree does not own both of its
    ends (``pipe:[ino]``, ``tty[rdev:dev]``): such a descriptor cannot come back as it was and
    is replaced at restore (see ``on_restore``). Empty when CRIU restores it itself.
    """

    pid: int
    fd: int
    kind: StdioKind
    target: str
    writable: bool
    external_key: str = ""

    @property
    def on_restore(self) -> str:
        if not self.external_key:
            if self.kind is StdioKind.FILE:
                return "reopened at its path and offset"
            return "restored as it was"
        if self.kind is StdioKind.TTY:
            return "a new pseudo-terminal whose output goes to the restore's output file"
        if self.writable:
            return "the restore's output file"
        return "/dev/null (reads see end of file)"


class CudaState(enum.Enum):
    """The driver's checkpoint state of a CUDA process (CUprocessState)."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


UNKNOWN_GPU = "(unknown GPU)"
"""``GpuInfo.name`` of a GPU NVML could not read (one per-GPU call failed): it is listed, so
the node's GPU count stays right, but matches no model."""

_GPU_UUID_BODY = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def normalize_gpu_uuid(text: str) -> str:
    """NVML's form of a GPU UUID, ``GPU-`` + lower-case ``8-4-4-4-12`` hex, from any case, with
    or without the ``GPU-`` prefix or the dashes. Text that is no GPU UUID comes back stripped
    but otherwise unchanged (it then matches no GPU). Idempotent."""
    body = text.strip()
    if body[:4].upper() == "GPU-":
        body = body[4:]
    digits = body.replace("-", "").lower()
    if len(digits) == 32 and all(c in "0123456789abcdef" for c in digits):
        shaped = "-".join((digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]))
        if "-" not in body or _GPU_UUID_BODY.fullmatch(body.lower()):
            return "GPU-" + shaped
    return text.strip()


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    """The model as NVML names it; ``UNKNOWN_GPU`` when NVML could not read this GPU."""
    uuid: str
    """NVML's form, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` ("" for an unknown GPU whose
    UUID could not be read)."""
    memory_total: int
    memory_free: int = 0
    compute_capability: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class GpuUse:
    """Device memory a process holds on one GPU."""

    pid: int
    uuid: str
    memory: int


@dataclass(frozen=True)
class GpuInventory:
    """This node's GPUs as NVML sees them. ``available`` False: ``message`` says why."""

    available: bool
    message: str
    driver_version: str = ""
    cuda_version: int = 0
    """cuDriverGetVersion form: 1000*major + 10*minor (12080 = 12.8)."""
    gpus: tuple[GpuInfo, ...] = ()
    """Every GPU of the node, NVML index order; one NVML could not read is listed with
    ``name`` ``UNKNOWN_GPU`` (and the reason in ``problems``)."""
    uses: tuple[GpuUse, ...] = ()
    problems: tuple[str, ...] = ()
    """Per-GPU NVML failures, one line each (the inventory is still available)."""
    mig_enabled: tuple[str, ...] = ()
    """UUIDs of the GPUs in MIG mode now (``nvmlDeviceGetMigMode``): the driver cannot
    checkpoint CUDA on them (cuda-checkpoint issue 42). Kept here, not on ``GpuInfo``, which
    records carry (an older daemon reads them with ``GpuInfo(**g)``)."""

    def by_uuid(self) -> dict[str, GpuInfo]:
        return {g.uuid: g for g in self.gpus if g.uuid}


@dataclass(frozen=True)
class GpuFacts:
    """What a checkpoint of CUDA processes records, to restore them and to check a node."""

    driver_version: str
    cuda_version: int
    gpus: tuple[GpuInfo, ...]
    """The GPUs the checkpointed processes used (not every GPU of the node)."""
    uses: tuple[GpuUse, ...]
    cuda_pids: tuple[int, ...]
    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    unlock_s: float = 0.0
    node_gpus: tuple[GpuInfo, ...] = ()
    """Every GPU of the dumping node, NVML index order: the driver's restore with a GPU map
    needs a pair for each (identity pairs included), so a remap is planned over these. Empty
    in records written before ckptd recorded them (issue #15): such a checkpoint restores
    onto the same GPUs only (a remap is refused, saying why)."""
    visible_gpus: tuple[str, ...] = ()
    """UUIDs of the dumping node's GPUs the checkpointed processes' CUDA could see (their
    container's ``/dev/nvidia<N>`` nodes, ``NVIDIA_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``;
    the union over ``cuda_pids``), NVML index order: a remap names exactly these
    (``ckptd.core.gpu_domain``). Every UUID of ``node_gpus`` when nothing restricted them;
    empty in records written before ckptd recorded it, or when it could not be read: the
    remap then covers ``node_gpus``."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuFacts:
        return cls(
            driver_version=str(data["driver_version"]),
            cuda_version=int(data["cuda_version"]),
            gpus=tuple(GpuInfo(**g) for g in data.get("gpus", ())),
            uses=tuple(GpuUse(**u) for u in data.get("uses", ())),
            cuda_pids=tuple(int(p) for p in data.get("cuda_pids", ())),
            lock_s=float(data.get("lock_s", 0.0)),
            checkpoint_s=float(data.get("checkpoint_s", 0.0)),
            restore_s=float(data.get("restore_s", 0.0)),
            unlock_s=float(data.get("unlock_s", 0.0)),
            node_gpus=tuple(GpuInfo(**g) for g in data.get("node_gpus", ())),
            visible_gpus=tuple(str(u) for u in data.get("visible_gpus", ())),
        )


class FileKind(enum.StrEnum):
    """Why a checkpoint needs a path of the node."""

    EXE = "exe"  # the executable of a process
    MAP = "map"  # a file-backed memory mapping (shared libraries, mapped data)
    FILE = "file"  # an open regular file (/proc/PID/fd)
    CWD = "cwd"  # a process's working directory
    MOUNT = "mount"  # the mount point a needed path lives on


HASH_LIMIT = 1 << 20
"""Files up to this size get a content hash in the fingerprint."""


@dataclass(frozen=True)
class FileNeed:
    """A path the checkpointed tree used, as it was at dump (or as it is now on a node).

    ``size``/``mtime_ns`` are 0 for directories and mount points; ``hash`` (xxh3-128 hex) is
    set only for regular files of at most ``HASH_LIMIT`` bytes that are not ``writable``."""

    path: str
    kind: FileKind
    size: int = 0
    mtime_ns: int = 0
    hash: str = ""
    writable: bool = False
    """A file the tree may write to (open for writing, or mapped shared and writable): it may
    grow and change after the dump (only its presence and its size at dump, the least CRIU
    needs, are checked)."""
    append_only: bool = False
    """Written only through O_APPEND descriptors (and not mapped): CRIU does not check its
    size at restore, only that it exists."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileNeed:
        return cls(
            path=str(data["path"]),
            kind=FileKind(data["kind"]),
            size=int(data.get("size", 0)),
            mtime_ns=int(data.get("mtime_ns", 0)),
            hash=str(data.get("hash", "")),
            writable=bool(data.get("writable", False)),
            append_only=bool(data.get("append_only", False)),
        )


@dataclass(frozen=True)
class NodeFingerprint:
    """What a checkpoint needs of the node it is restored on: the node's facts at dump, and
    every file the tree used (``files``, one entry per path). On a node's own fingerprint
    (``NodeInspector.here``) ``files`` is empty."""

    arch: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    kernel: str
    libc: str
    """e.g. ``glibc 2.36``; empty when unknown."""
    criu_version: str = ""
    files: tuple[FileNeed, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_flags"] = list(self.cpu_flags)
        data["files"] = [f.to_json() for f in self.files]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeFingerprint:
        return cls(
            arch=str(data["arch"]),
            cpu_model=str(data.get("cpu_model", "")),
            cpu_flags=tuple(str(f) for f in data.get("cpu_flags", ())),
            kernel=str(data.get("kernel", "")),
            libc=str(data.get("libc", "")),
            criu_version=str(data.get("criu_version", "")),
            files=tuple(FileNeed.from_json(f) for f in data.get("files", ())),
        )


@dataclass(frozen=True)
class CapturedFile:
    """A regular file the tree wrote to (open for writing, or mapped shared and writable),
    its content at the checkpoint kept in the store like pages: ``image`` names it among the
    checkpoint's images (zero-padded to whole pages). A restore puts it back first."""

    path: str
    size: int
    mode: int
    uid: int
    gid: int
    hash: str
    """xxh3-128 hex of its ``size`` bytes."""
    image: str
    dirs: tuple[tuple[int, int, int], ...] = ()
    """Every directory from the root down to the file's, as (owner uid, st_dev, st_ino) at
    the checkpoint: a restore refuses a chain whose owners (or, on the same boot, whose
    directories) changed since. Empty in checkpoints from before it was recorded."""
    boot: str = ""
    """The node's boot id at the checkpoint (directory identities compare only within it)."""
    dev: int = 0
    ino: int = 0
    """The file's identity (``st_dev``, ``st_ino``) at the checkpoint (0: not recorded): on the
    same boot, a restore follows it where a log rotation moved it (docs/adr/0017)."""
    rotated: tuple[tuple[str, int, int], ...] = ()
    """The files beside it named ``<name>.*`` (its rotated set: ``job.log.1``, ...) at the
    checkpoint, as (name, st_dev, st_ino); asides (``.ckptd-``) left out."""
    at_ns: int = 0
    """When it was captured (``time.time_ns()``; 0: not recorded)."""
    writers: tuple[str, ...] = ()
    """The processes outside the tree that held it open for writing or mapped it writable
    when the dump looked (before freezing), as "pid N (command)": ``ckptctl show`` lists
    them; a restore looks again for live ones (``shared_files``)."""
    size_free: bool = False
    """Every descriptor of the tree writing it was ``O_WRONLY|O_APPEND`` and none mapped it:
    CRIU records no size for it (a log), so it may be left grown at a restore."""


@dataclass(frozen=True)
class CompatReport:
    """Whether a checkpoint can be restored on this node: every ``blocking`` difference
    (restore refuses) and every ``warning`` (restore refuses unless told to ignore them);
    ``notes``: what a restore will do on the way that changes the node (files put back)."""

    blocking: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def compatible(self) -> bool:
        return not self.blocking and not self.warnings


@dataclass(frozen=True)
class DumpRequest:
    pid: int
    leave_running: bool = False
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    keep: int = 0
    """With a name: after the commit, keep only the ``keep`` newest checkpoints of that name."""
    tcp_close: bool = False
    """Allow TCP connections to peers outside the tree: a restore brings the tree's
    connections back closed (the application sees a reset). Off: such a tree is refused."""
    tcp_peers_dumped: bool = False
    """The peers outside the tree are checkpointed with it (a group): its connections are
    dumped and restored established, whoever the peer."""
    cgroup: str = ""
    """The target as a container's cgroup (v2 path; ``pid`` 0): its init's job is dumped.
    A ``pid`` that is a container's init also names its job (``targets.container_job``)."""
    files_dirs: tuple[str, ...] = ()
    """Output directories (absolute, as the job sees them): every regular file under each is
    captured by content too, whether the tree holds it open or not (``ckptctl run --files``:
    loggers that open, append and close per step), and put back by a restore."""


@dataclass(frozen=True)
class RestoreRequest:
    """Exactly one of ``checkpoint_id``, ``pid`` (its latest checkpoint), ``name`` is set."""

    checkpoint_id: str = ""
    pid: int = 0
    name: str = ""
    output_path: str = ""
    gpu_map: Mapping[str, str] = field(default_factory=dict)
    """Old GPU UUID -> this node's GPU UUID, to choose the GPUs (default: the same GPUs when
    present, else free ones of the same model)."""
    ignore_warnings: bool = False
    """Restore despite compatibility warnings (never despite blocking differences)."""
    into_callers_container: bool = False
    """Restore inside the caller's container, as its child (the caller is the container's
    init: ``ckptctl run`` in the next pod). Only for container checkpoints."""
    lazy: bool = False
    """Let the tree run before its memory is back (``core.lazyrestore``)."""


@dataclass(frozen=True)
class Progress:
    stage: str
    message: str
    fraction: float = 0.0


@dataclass(frozen=True)
class CheckpointRecord:
    """The facts of one committed checkpoint (what List/Get return).

    Invariant: a record exists in a store only once everything it names is durable.
    """

    id: str
    pid: int
    created: float
    node: str
    uid: int
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    leave_running: bool = False
    processes: tuple[ProcessFact, ...] = ()
    stdio: tuple[StdioFact, ...] = ()
    bytes: int = 0
    bytes_logical: int = 0
    bytes_new: int = 0
    frozen_s: float = 0.0
    duration_s: float = 0.0
    criu_version: str = ""
    parent_id: str = ""
    gpu: GpuFacts | None = None
    """Set when the tree used CUDA: what a restore needs of the node's GPUs."""
    fingerprint: NodeFingerprint | None = None
    """The node's facts and the files the tree used, at dump (None: an older checkpoint)."""
    files: tuple[CapturedFile, ...] = ()
    """Files the tree wrote, their content at the checkpoint (put back by a restore)."""
    files_skipped: tuple[str, ...] = ()
    """Written files not captured (over the size limit, configured to skip), one line each."""
    tcp_connections: int = 0
    """Connected TCP sockets dumped (CRIU's tcp-established; a restore needs it too)."""
    tcp_close: bool = False
    """A restore brings those connections back closed (peers outside the tree)."""
    tcp: tuple[TcpConnection, ...] = ()
    """The TCP connections CRIU's images hold (read from them at dump; pid 0), in every
    state: ``tcp_connections`` counts them and a restore passes CRIU ``tcp_established``
    (or ``tcp_close``) whenever there is one. Empty for a checkpoint of an older ckptd."""
    container: bool = False
    """A job in a container (not its init): dumped by CRIU run inside the container's
    namespaces, so the images hold a plain tree and pids of the container's namespace
    (each process's ``ns_pid``); a restore must run inside a container (issue #12). What
    it needs of the next container is recorded with the rest: ``fingerprint`` holds the files
    it maps and mounts it uses *as the container saw them* (its image's files, by content
    hash or size and mtime), ``gpu`` its GPUs."""
    container_memory_limit: int = 0
    """The container's memory limit at the checkpoint, bytes (0: none, or not known)."""

    @property
    def own_pid_namespace(self) -> bool:
        """The tree is the init of a pid namespace of its own (``unshare --fork --pid``, a
        container): a restore creates a new namespace, so its pids cannot clash with the
        node's, and the restored processes get new pids on the node."""
        return bool(self.processes) and self.processes[0].ns_pid == 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"] = dict(self.labels)
        data["stdio"] = [{**asdict(s), "kind": s.kind.value} for s in self.stdio]
        data["gpu"] = self.gpu.to_json() if self.gpu else None
        data["fingerprint"] = self.fingerprint.to_json() if self.fingerprint else None
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        values["labels"] = dict(values.get("labels", {}))
        values["processes"] = tuple(
            ProcessFact(**{**p, "cmdline": tuple(p["cmdline"])}) for p in data.get("processes", ())
        )
        values["stdio"] = tuple(
            StdioFact(**{**s, "kind": StdioKind(s["kind"])}) for s in data.get("stdio", ())
        )
        gpu = data.get("gpu")
        values["gpu"] = GpuFacts.from_json(gpu) if gpu else None
        fingerprint = data.get("fingerprint")
        values["fingerprint"] = NodeFingerprint.from_json(fingerprint) if fingerprint else None
        values["files"] = tuple(
            CapturedFile(**{**f, "dirs": tuple(tuple(d) for d in f.get("dirs", ())),
                            "rotated": tuple((str(r[0]), int(r[1]), int(r[2]))
                                             for r in f.get("rotated", ())),
                            "writers": tuple(f.get("writers", ()))})
            for f in data.get("files", ())
        )
        values["files_skipped"] = tuple(data.get("files_skipped", ()))
        values["tcp"] = tuple(TcpConnection(**c) for c in data.get("tcp", ()))
        return cls(**values)


@dataclass(frozen=True)
class PinnedBy:
    """What one checkpoint keeps in the store: the packs it names and their stored bytes;
    ``bytes_alone``: of those, the packs no other checkpoint names (freed with it)."""

    checkpoint_id: str
    packs: int = 0
    bytes: int = 0
    bytes_alone: int = 0


@dataclass(frozen=True)
class GcReport:
    deleted_checkpoints: tuple[str, ...] = ()
    packs_deleted: int = 0
    blobs_deleted: int = 0
    bytes_freed: int = 0
    packs_kept: int = 0
    bytes_kept: int = 0
    packs_rewritten: int = 0
    """Packs compacted: their live pages copied into ``packs_written`` new ones."""
    bytes_rewritten: int = 0
    packs_written: int = 0
    bytes_written: int = 0
    bytes_condemned: int = 0
    """Of ``bytes_kept``: packs no checkpoint needs, deleted once the grace period passed."""
    pinned: tuple[PinnedBy, ...] = ()
    skipped: tuple[str, ...] = ()
    """What this run could not do, one line each, saying why and what to do (a full store:
    compaction, condemning); what was freed was freed all the same."""


@dataclass(frozen=True)
class VerifyReport:
    """``problems`` names every damaged or missing object; empty means all was checked good."""

    checked: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    packs_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class RestoreOutcome:
    checkpoint_id: str
    pid: int
    output_path: str
    duration_s: float
    stdio: tuple[StdioFact, ...] = ()
    files_put_back: tuple[str, ...] = ()
    """Paths the restore put back to their checkpoint content."""
    files_kept: tuple[str, ...] = ()
    """Where the versions found on disk were kept (beside each file put back)."""
    files_left: tuple[str, ...] = ()
    """Captured files left as they were found because a process outside the tree writes
    them (``shared_files = "keep"``), each as "PATH (written by pid N (command))"."""
    cgroup: str = ""
    """The cgroup (v2) the restored tree was placed in; empty when ckptd placed nothing."""
    ns_pid: int = 0
    """The restored root's pid in the caller's pid namespace (a restore into the caller's
    container), else 0."""
    tcp_closed: str = ""
    """Set when the tree's TCP connections came back closed because this node lacks a
    connection's local address: one line naming them (the restore's event carries it)."""
    lazy: bool = False
    """A lazy restore: the tree runs while its pages are still being served."""


@dataclass(frozen=True)
class CriuStatus:
    """What this node's CRIU is. ``ok`` False means dumps will be refused with ``message``."""

    path: str
    version: str
    ok: bool
    message: str


@dataclass(frozen=True)
class Feature:
    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class RuntimeFacts:
    """What this node gives containers, as the daemon sees it (``ckptctl check``).

    ``cgroup``: ``unified`` (cgroup v2 only), ``hybrid`` (v1 controllers beside a cgroup2
    mount: crun refuses it), ``legacy`` (v1 only) or ``""`` (none mounted / unreadable).
    ``oci_runtimes``: paths of the runc/crun found. ``podman_runtime``: podman's default OCI
    runtime (``""``: no podman, or unknown). ``warnings``: one line each, what is wrong and
    what to do; empty when nothing is."""

    cgroup: str = ""
    cap_sys_resource: bool = True
    oci_runtimes: tuple[str, ...] = ()
    podman_runtime: str = ""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeReport:
    node: str
    kernel: str
    criu: CriuStatus
    features: tuple[Feature, ...] = ()
    gpu_available: bool = False
    gpu_message: str = ""
    store: str = ""
    gpu: GpuInventory | None = None
    runtime: RuntimeFacts = field(default_factory=RuntimeFacts)
