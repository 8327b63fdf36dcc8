"""The ports of ckptd's core: what it needs from the outside world, as Protocols.

Each port has a real adapter under ``ckptd.adapters`` and a fake in ``ckptd.testing``; both
pass the same contract suite under ``tests/contract``.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckptd.domain import (
    CapturedFile,
    CheckpointRecord,
    CriuStatus,
    CudaState,
    FileKind,
    FileNeed,
    GcReport,
    GpuInventory,
    GroupRecord,
    NodeFingerprint,
    PeerProbe,
    PidState,
    PidStatus,
    Policy,
    ProcessFact,
    RemoteRestore,
    StdioFact,
    TcpConnection,
    VerifyReport,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class ProcessHandle(Protocol):
    """One process, held from the moment it was identified (a pidfd on Linux).

    Invariant: whatever a handle does reaches the process it was opened on, or nothing:
    once that process is gone its pid may belong to another, and the handle never touches
    it. Pids are the daemon's (its pid namespace). Close it when done (idempotent)."""

    @property
    def pid(self) -> int:
        """The pid it had when identified (the daemon's namespace)."""
        ...

    @property
    def start_time(self) -> int: ...

    def signal(self, signo: int) -> bool:
        """Send ``signo`` to this process; False when it is gone (reaped)."""
        ...

    def state(self) -> PidState:
        """RUNNING, STOPPED, ZOMBIE (exited, not reaped), or FREE (gone)."""
        ...

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for it to exit (zombie or gone); True when it has."""
        ...

    def close(self) -> None: ...


class ProcessTable(Protocol):
    """Read-only view of the host's processes; signals only through ``ProcessHandle`` s."""

    def status(self, pid: int) -> PidStatus:
        """What occupies ``pid`` now (``PidState.FREE`` when nothing)."""
        ...

    def tree(self, pid: int) -> tuple[ProcessFact, ...]:
        """``pid`` and all its descendants, root first, each with its start time and its
        ``ns_pid`` (its pid in the root's pid namespace when that is not the daemon's).
        Raises ProcessNotFound."""
        ...

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """Parent, grandparent, ... up to pid 1 (excluding ``pid``)."""
        ...

    def stdio(self, tree: Sequence[ProcessFact]) -> tuple[StdioFact, ...]:
        """Descriptors 0-2 of every process of ``tree``, with external ones marked."""
        ...

    def open(self, pid: int, start_time: int = 0) -> ProcessHandle | None:
        """A handle on the process at ``pid`` now; None when the pid is free or (with
        ``start_time`` not 0) holds a process that started at another time."""
        ...

    def foreign_namespaces(self, pid: int) -> frozenset[str]:
        """The namespaces (``pid``, ``mnt``, ``net``, ``ipc``, ``uts``, ``user``, ``cgroup``,
        ``time``) in which ``pid`` differs from the daemon; empty when it is gone."""
        ...

    def pid_namespace_init(self, pid: int) -> int:
        """The pid (the daemon's namespace) of the init of ``pid``'s pid namespace (pid 1
        inside it; ``pid`` itself when it is that init); 0 when ``pid`` is in the daemon's
        pid namespace, is gone, or no such init is found among its ancestors."""
        ...

    def namespaces_differing(self, pid: int, other: int) -> frozenset[str]:
        """The namespaces (the kinds of ``foreign_namespaces``) in which ``pid`` and
        ``other`` differ; every kind when either is gone."""
        ...

    def reserve_pids(self, pid: int, above: int, start_time: int = 0) -> int:
        """In the pid namespace of ``pid`` (a container's), make the next pids handed out be
        above ``above`` (the counter is never lowered), so that a job started there now can be
        restored into another container whose own processes took the low pids. Returns the
        namespace's counter after; 0 when ``pid`` shares the daemon's pid namespace (nothing
        done). Raises ProcessNotFound when ``pid`` is gone, or (``start_time`` not 0) holds
        a process that started at another time: the namespace is taken from the process
        with that start time only, pinned while it is opened."""
        ...

    def own_root(self, pid: int) -> bool:
        """Whether ``pid``'s root directory is not the daemon's (a container's root file
        system, after pivot_root or chroot); False when it is gone."""
        ...

    def ns_pid_taken(self, init: int, ns_pid: int) -> str:
        """What holds pid ``ns_pid`` of the pid namespace whose init is ``init`` (a node
        pid): its command name, or "" when that pid (process or thread id) is free there."""
        ...

    def tcp_connections(self, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
        """Every connected TCP socket a process of ``tree`` holds (listening ones are not
        connections), with its addresses as seen in that process's network namespace."""
        ...

    def io_uring_holders(self, tree: Sequence[ProcessFact]) -> tuple[int, ...]:
        """The pids of ``tree``, in its order, whose processes hold an io_uring instance (a
        descriptor on one, or a mapping of its rings), which CRIU cannot checkpoint. A process
        gone meanwhile holds none."""
        ...


class ThreadHold(Protocol):
    """Every thread of a process held stopped but one, which runs (docs/adr/0019): how the
    CUDA driver's restore thread restores and unlocks a process while nothing else of it
    runs (as CRIU's CUDA plugin does under ptrace). Pids and tids are the daemon's.

    Invariants: a held thread does not run until ``release``; the free thread is never
    held (it runs once the process is not stopped: a SIGCONT wakes it and only it); threads
    that appear while the hold is taken are held too; a daemon that dies holding releases
    every held thread (the kernel detaches a dead tracer's tracees). Thread-safe."""

    def hold(self, pid: int, free_tid: int) -> tuple[int, ...]:
        """Hold every thread of process ``pid`` except ``free_tid`` (a thread of it); the
        tids held. Raises ``ProcessNotFound`` when ``pid`` is gone, ``PreconditionFailed``
        when a thread cannot be held (another tracer, ptrace not permitted): nothing is
        then left held."""
        ...

    def release(self, pid: int) -> None:
        """Let every thread held for ``pid`` run again (those of a process stopped by a
        signal stay stopped with it); nothing held: nothing done. Never raises."""
        ...


class Cgroups(Protocol):
    """The node's cgroup v2 hierarchy (the unified one), as the daemon sees it.

    A cgroup is named by its path in the hierarchy (``/`` the root, ``/a/b`` below it), as
    ``/proc/PID/cgroup``'s ``0::`` line says. Moving a process moves all its threads.
    Invariant: a cgroup this port creates is only ever created together with the move that
    populates it, so ``remove_empty`` never removes one that a concurrent ``move`` was about
    to use."""

    def cgroup_of(self, pid: int) -> str:
        """The cgroup of the process at ``pid``. Raises ProcessNotFound when it is gone,
        CgroupUnavailable when it cannot be told (outside the daemon's cgroup namespace)."""
        ...

    def move(self, pids: Sequence[int], cgroup: str, *, create: bool = False) -> None:
        """Move each process of ``pids`` into ``cgroup``; with ``create``, create it first
        when missing (and its missing parents). Raises ProcessNotFound when one is gone,
        CgroupUnavailable naming the cgroup and why it takes no processes (missing; child
        cgroups with controllers enabled: cgroup v2's "no internal processes" rule; an
        invalid domain in a threaded subtree). Processes moved before a failure stay moved."""
        ...

    def remove_empty(self, parent: str) -> list[str]:
        """Remove every child cgroup of ``parent`` that holds no process and no cgroup;
        returns them. Never raises (what cannot be removed stays)."""
        ...

    def procs(self, cgroup: str) -> tuple[int, ...]:
        """The processes in ``cgroup`` itself (not its descendants). Raises
        CgroupUnavailable when it does not exist."""
        ...

    def memory_limit(self, pid: int) -> MemoryLimit | None:
        """The tightest memory limit over the cgroups of ``pid`` (every hierarchy, each
        cgroup and its ancestors) with what is charged there now; None when unlimited.
        Raises ProcessNotFound when ``pid`` is gone."""
        ...


@dataclass(frozen=True)
class MemoryLimit:
    """A cgroup's memory limit (``memory.max``, v1's ``memory.limit_in_bytes``)."""

    cgroup: str
    limit: int
    usage: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


class NodeInspector(Protocol):
    """This node's facts (CPU, kernel, libc) and the files a process tree uses.

    Paths are as this daemon sees them (its mount namespace). Never raises for a process that
    went away or a file that cannot be read: those are left out."""

    def here(self) -> NodeFingerprint:
        """This node's facts; ``files`` empty, ``criu_version`` empty (the core knows CRIU)."""
        ...

    def fingerprint(self, tree: Sequence[ProcessFact]) -> NodeFingerprint:
        """``here()`` plus every path ``tree`` uses (executables, file-backed mappings, open
        regular files, working directories, and the mount points they live on), one entry
        per path, content-hashed when at most ``HASH_LIMIT`` bytes."""
        ...

    def file(self, path: str, kind: FileKind, with_hash: bool) -> FileNeed | None:
        """``path`` as it is on this node now (None: missing). For EXE/MAP/FILE a regular
        file (hashed when ``with_hash`` and small); CWD a directory; MOUNT a mount point."""
        ...

    def has_address(self, address: str) -> bool:
        """Whether this node (the daemon's network namespace) has the local IP address of
        ``address`` (``ip:port`` or ``[ipv6]:port``): a TCP connection from it can be
        restored established here."""
        ...

    def seen_by(self, pid: int) -> NodeInspector:
        """The same inspector with every path resolved as process ``pid`` sees it: in its
        root file system and mount table (a container's), never escaping that root through
        a symbolic link. Raises ProcessNotFound when ``pid`` is gone."""
        ...


# ---- files the job writes ------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenFile:
    """A regular file a process of a tree has open for writing or maps shared-writable."""

    path: str
    """As the daemon sees it (its mount namespace)."""
    size: int
    source: str
    """Where its content is read from: the writing process's own descriptor or mapping, so a
    path replaced meanwhile is never read instead."""
    pid: int
    append_only: bool = False
    """Every descriptor of the tree that writes it appends (O_APPEND) and none maps it: what
    is in it now stays as it is while the tree runs (it can only grow), so it can be copied
    before the tree is frozen and only its new tail while it is."""


@dataclass(frozen=True)
class Precopy:
    """The first ``size`` bytes of an append-only file, copied while the tree ran; ``state``
    is the adapter's (the file's identity, the running hash)."""

    path: str
    size: int
    state: object = None


@dataclass(frozen=True)
class FileCheck:
    """A captured file against what is at its path now."""

    differs: bool
    """Missing, or another size or content: a restore puts it back (keeping this one)."""
    problem: str = ""
    """Why it could not be put back ("" when it can)."""


@dataclass(frozen=True)
class PutBack:
    """One file a restore put back (or is about to): ``aside`` holds the version found there
    ("" when there was none: the file was ``created``). ``dev``/``ino`` identify the file put
    back (0 while it is not created yet), so that an undo acts only on that very file;
    ``temp`` is the temporary a crash may have left beside it (removed by the undo);
    ``mode`` the permission bits found (put back by the undo; 0 for a created file);
    ``moved_from``: the file (``dev``/``ino``) was only renamed from that path to ``path``
    (following a log rotation): the undo renames it back."""

    path: str
    aside: str
    created: bool = False
    dev: int = 0
    ino: int = 0
    temp: str = ""
    mode: int = 0
    moved_from: str = ""


class JobFiles(Protocol):
    """The files a tree writes: listed and captured at a checkpoint (the tree frozen), put
    back at a restore. Content operations act with the given owner's file-system rights."""

    def written(self, tree: Sequence[ProcessFact]) -> tuple[WrittenFile, ...]:
        """Every regular file ``tree`` has open for writing or mapped shared and writable,
        one per path (deleted files, /proc, /sys and devices left out; /dev/shm kept)."""
        ...

    def precopy(self, file: WrittenFile, dest: Path) -> Precopy | None:
        """Copy what an append-only file holds now to ``dest`` (the tree running); None when
        gone."""
        ...

    def capture(
        self, file: WrittenFile, dest: Path, precopy: Precopy | None = None
    ) -> CapturedFile | None:
        """Copy its content to ``dest`` (zero-padded to whole pages); None when gone. With
        the ``precopy`` made into ``dest``, only what was appended since is copied (all of it
        when the file is another one now, or shorter)."""
        ...

    def check(self, captured: CapturedFile, uid: int, gid: int) -> FileCheck: ...

    def put_back(
        self, captured: CapturedFile, content: Path, aside: str, uid: int, gid: int,
        before: Callable[[PutBack], None],
    ) -> PutBack | None:
        """Make ``captured.path`` hold the first ``captured.size`` bytes of ``content``; a
        version there that differs is first copied to ``aside`` (complete before it gets
        that name). None: it already held them. On failure the file is as it was.
        ``before`` is called with what undoes each effect before that effect can exist (the
        recipe journals it). Refuses (an ``OSError``) a path with a link on the way, a hard-
        linked file, a file or directory whose owner (or identity) changed since the dump."""
        ...

    def prune_asides(
        self, path: str, keep: int, max_age_s: float, uid: int, gid: int
    ) -> tuple[str, ...]:
        """Remove the copies kept aside of ``path`` beyond the ``keep`` newest and those
        older than ``max_age_s`` (0: no age limit), as the file's owner; the paths removed.
        Never raises for a missing directory (nothing to remove)."""
        ...

    def undo(self, done: PutBack, uid: int, gid: int) -> None:
        """The file exactly as ``put_back`` found it (the copy aside removed), from any point
        a put-back reached (also after a crash, from the journaled ``PutBack``)."""
        ...

    def seen_by(self, pid: int) -> JobFiles:
        """The same port with ``check``/``put_back``/``undo`` acting on paths as process
        ``pid`` sees them (its root file system: a container's), never escaping that root
        through a symbolic link. Raises ProcessNotFound when ``pid`` is gone."""
        ...


# ---- CRIU -------------------------------------------------------------------------------------


class CriuHooks:
    """Callbacks for CRIU's notifications during a dump or restore. Override what you need.

    The defaults do nothing. A hook that raises makes CRIU abort the operation (CRIU then
    resumes a dumped tree, or kills a half-restored one). ``pid`` is the tree's root pid when
    CRIU says it, else 0.
    """

    def pre_dump(self, pid: int) -> None:
        """Before CRIU seizes any process of the tree."""

    def network_lock(self, pid: int) -> None: ...

    def post_dump(self, pid: int) -> None:
        """Images written, the tree still frozen."""

    def network_unlock(self, pid: int) -> None: ...

    def criu_started(self, criu_pid: int) -> None:
        """Restores only: CRIU's process (``criu_pid``, the daemon's pid namespace) exists and
        has not begun: nothing of the tree exists yet, and whatever CRIU creates is born in
        CRIU's cgroup (when ``CriuRestoreJob.restore_cgroups`` is false)."""

    def pre_restore(self, pid: int) -> None: ...

    def setup_namespaces(self, pid: int) -> None: ...

    def post_restore(self, pid: int) -> None:
        """The tree exists again, not yet resumed."""

    def pre_resume(self, pid: int) -> None: ...

    def post_resume(self, pid: int) -> None:
        """The restored tree runs."""


class ForwardingHooks(CriuHooks):
    """Hooks that pass every notification on to ``inner``: the base of a hook set that adds
    to another's (override a notification, do its own part, then call ``super()``)."""

    def __init__(self, inner: CriuHooks) -> None:
        self.inner = inner

    def pre_dump(self, pid: int) -> None:
        self.inner.pre_dump(pid)

    def network_lock(self, pid: int) -> None:
        self.inner.network_lock(pid)

    def post_dump(self, pid: int) -> None:
        self.inner.post_dump(pid)

    def network_unlock(self, pid: int) -> None:
        self.inner.network_unlock(pid)

    def criu_started(self, criu_pid: int) -> None:
        self.inner.criu_started(criu_pid)

    def pre_restore(self, pid: int) -> None:
        self.inner.pre_restore(pid)

    def setup_namespaces(self, pid: int) -> None:
        self.inner.setup_namespaces(pid)

    def post_restore(self, pid: int) -> None:
        self.inner.post_restore(pid)

    def pre_resume(self, pid: int) -> None:
        self.inner.pre_resume(pid)

    def post_resume(self, pid: int) -> None:
        self.inner.post_resume(pid)


@dataclass(frozen=True)
class CriuPlacement:
    """Where CRIU runs for a job in a container (docs/design/containers.md): inside the
    namespaces (all but user and time) and cgroups of the container's init, a process of
    its pid namespace."""

    init: int
    """The container's init, the daemon's pid."""
    init_start_time: int
    """Its start time: a pid reused meanwhile is never entered."""
    ns_pid: int
    """The dumped tree's root as the container's pid namespace numbers it (what CRIU is
    given, and what its notifications and images say)."""


class PageSink(Protocol):
    """Where a dump's pages go as CRIU sends them: called on one thread, in order."""

    def begin_image(self, name: str) -> None:
        """A pages image (``pages-<n>.img``) begins."""

    def pages(self, name: str, offset: int, data: memoryview) -> None:
        """The next bytes (whole pages, at ``offset`` in the image). ``data`` is valid only
        during the call: keep a copy of what must outlive it."""

    def end_image(self, name: str, size: int) -> None:
        """The pages image is complete (``size`` bytes)."""


@dataclass(frozen=True)
class CriuDumpJob:
    pid: int
    images_dir: Path
    work_dir: Path
    leave_running: bool
    leave_stopped: bool = False
    shell_job: bool = True
    tcp_established: bool = False
    """Dump established TCP connections (the network is locked with nftables meanwhile)."""
    ext_unix_sk: bool = False
    container: CriuPlacement | None = None
    """None: CRIU runs in the daemon's namespaces. Else inside the container, which it does
    not dump (cgroups ignored, the images name pids of the container's namespace)."""
    page_server_fd: int = -1
    """>= 0: CRIU sends the pages over this connected socket (``opts.ps.fd``, CRIU's
    page-server protocol, see ``adapters.criu.pageserver``) instead of writing pagemap and
    pages images; the caller receives them. Not for container jobs."""
    page_sink: PageSink | None = None
    """CRIU's pages go to this sink as CRIU sends them (the adapter runs the page server;
    every page has reached the sink when the post-dump hook is called); only the other
    images, pagemaps included, are written to ``images_dir``. Not for container jobs."""
    ghost_limit: int = 1 << 20
    """Largest ghost file CRIU dumps (bytes; CRIU's own default: 1 MiB): a file the tree
    holds open (or mapped) after it was deleted, such as PyTorch's shared memory, whose
    content goes into the images. A larger one fails the dump."""


@dataclass(frozen=True)
class CriuDumpResult:
    frozen_s: float
    freezing_s: float
    pages_written: int
    duration_s: float
    pids: tuple[int, ...] = ()
    """Every pid CRIU dumped, root first (the tree as it was when frozen)."""


@dataclass(frozen=True)
class InheritFd:
    """Give the restored tree our ``fd`` where it had the external resource ``key``."""

    key: str
    fd: int


class ImageSource(Protocol):
    """A checkpoint's images read from where they are kept as CRIU asks for them (a streamed
    restore), instead of a directory written first.

    Invariants: ``chunks`` yields only bytes already verified against the checkpoint's hashes,
    in order, together exactly the image (a pages image's zero pages as zeros); it raises
    (``CorruptCheckpoint`` naming the checkpoint and the damaged or missing object) before
    yielding anything unverified, so a consumer that stops at the error never holds a wrong
    byte, only too few. Memory stays bounded by a few frames per open image, whatever its size.
    Thread-safe: several images may be read at once."""

    checkpoint_id: str

    def exists(self, name: str) -> bool:
        """Whether the checkpoint has an image ``name``."""
        ...

    def size(self, name: str) -> int:
        """The size in bytes of image ``name`` (KeyError if it has none)."""
        ...

    def chunks(self, name: str) -> Iterator[memoryview]:
        """The bytes of image ``name``, in order (each chunk valid until the next is asked
        for)."""
        ...

    def write(self, name: str, path: Path) -> None:
        """Write image ``name`` to ``path`` (a new file), verified, as a checkout does."""
        ...


@dataclass(frozen=True)
class CriuRestoreJob:
    images_dir: Path
    work_dir: Path
    inherit_fds: tuple[InheritFd, ...] = ()
    shell_job: bool = True
    tcp_established: bool = False
    tcp_close: bool = False
    """Restore the dumped TCP connections closed (their peers were not dumped)."""
    ext_unix_sk: bool = False
    leave_stopped: bool = False
    """Every restored task stays stopped (SIGSTOP) until sent SIGCONT (group restores)."""
    restore_cgroups: bool = True
    """CRIU puts each task back in the cgroups it was dumped from (creating missing ones:
    CRIU's default). False: CRIU leaves cgroups alone (its ``ignore`` mode), so the tree is
    born in CRIU's own cgroup, where the caller placed CRIU (``CriuHooks.criu_started``)."""
    container: CriuPlacement | None = None
    """None: CRIU runs in the daemon's namespaces. Else inside the container of
    ``container.init`` (its namespaces and cgroups; ``ns_pid`` unused): the images' pids
    are made free there first (every pid and thread id checked, the namespace's counter
    moved past them), the tree is born there and becomes that init's child when CRIU exits;
    the notified and returned pids are node pids."""
    images: ImageSource | None = None
    """None: CRIU reads its images from ``images_dir``. Else CRIU asks for each image and
    reads it from this source as it is verified (``Criu.can_stream_restore``; not with
    ``container``); ``images_dir`` then holds no image CRIU needs (only ckptd's own files)
    and a restore whose source fails is undone before any process runs."""


class CriuDumpInProgress(Protocol):
    """A dump CRIU has written and holds at its post-dump point: the tree frozen, its images
    complete, its network locked (established TCP connections in repair mode). Exactly one of
    ``finish`` or ``abort`` ends it; until then CRIU waits (a daemon that dies meanwhile makes
    CRIU abort: the tree runs on)."""

    @property
    def pids(self) -> tuple[int, ...]:
        """Every pid CRIU dumped, root first, as its images name them."""
        ...

    @property
    def holds_connections(self) -> bool:
        """The dump locked established TCP connections: once finished, a tree left stopped
        cannot be resumed by a signal (its sockets stay in repair mode)."""
        ...

    @property
    def tcp_sockets(self) -> tuple[TcpConnection, ...] | None:
        """The TCP sockets with a peer that CRIU's images hold (any state, TCP_CLOSE
        included: a restore needs CRIU's ``tcp_established`` or ``tcp_close`` for each), pid
        0; None when the images could not be read (the inspection's count then stands)."""
        ...

    def finish(self) -> CriuDumpResult:
        """CRIU completes: with ``leave_running`` the tree runs on (network unlocked); with
        ``leave_stopped`` it stays stopped, its connections locked (kill it: nothing reaches
        its peers). Raises CriuFailed when CRIU fails even now (the tree then runs on)."""
        ...

    def abort(self) -> None:
        """CRIU resumes the tree as it was and unlocks its network. Idempotent; does nothing
        once ``finish`` was called."""
        ...


class Criu(Protocol):
    def status(self) -> CriuStatus: ...

    def dump(self, job: CriuDumpJob, hooks: CriuHooks) -> CriuDumpInProgress:
        """Dump the tree up to CRIU's post-dump point (``hooks.post_dump`` has run). On
        failure raises CriuFailed and the tree runs as before."""
        ...

    def restore(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        """Restore the tree; returns its root pid. On failure nothing of it remains."""
        ...

    def can_stream_restore(self) -> bool:
        """Whether ``restore`` takes ``CriuRestoreJob.images`` (a CRIU that streams images
        through its RPC service)."""
        ...


# ---- GPUs ------------------------------------------------------------------------------------


class GpuInventoryPort(Protocol):
    """This node's GPUs (NVML). ``inventory`` never raises: an unusable driver is
    ``available=False``."""

    def inventory(self) -> GpuInventory: ...

    def visible_to(self, pid: int) -> tuple[str, ...] | None:
        """The UUIDs of this node's GPUs that process ``pid`` (a host pid) can use, or None
        when nothing restricts it. In a container: those with a ``/dev/nvidia<N>`` node in
        its root (none at all: ``()``); anywhere: narrowed by the ``*_VISIBLE_DEVICES`` it
        was started with. Every UUID is one of ``inventory()``'s GPUs, each once, in
        ``inventory()``'s order. Raises ``GpuUnavailable`` when ``pid`` cannot be inspected
        (gone, not permitted)."""
        ...


@dataclass(frozen=True)
class CudaProcessFact:
    """What /proc shows of one process that the driver's checkpoint cannot take (read at
    inspect, before anything is frozen). Only what can be seen: CUDA IPC handles
    (``cuIpcOpenMemHandle``) and UVM (managed) allocations leave no mark in /proc that tells
    them apart — every CUDA process maps ``/dev/nvidia-uvm`` — so they are left to the
    driver's own refusal (``GpuSteps`` translates it)."""

    pid: int
    nccl: bool = False
    """A ``libnccl`` shared object is mapped (``/proc/<pid>/maps``)."""
    launch_job: str = ""
    """``CUDA_CHECKPOINT_JOB_FILE`` from the environment it started with: the process was
    started by ``cuda-checkpoint --launch-job`` (the r610 mechanism for CUDA IPC); ""
    when unset."""
    unreadable: str = ""
    """Why its /proc could not be read ("" when it could): the other fields are then
    unknown (False / "")."""


class CudaProcessFacts(Protocol):
    """Per process, what /proc says about workloads the CUDA driver cannot checkpoint."""

    def cuda_facts(self, pid: int) -> CudaProcessFact:
        """``pid``'s facts (a host pid). Never raises: a process whose /proc cannot be read
        (gone, not permitted) gives a fact with ``unreadable`` set."""
        ...


class GpuCheckpointer(Protocol):
    """The CUDA driver's checkpoint API for one process at a time (host pids).

    Every call may block for long (a checkpoint copies all device memory to the host); the
    adapter runs them where they cannot stall the daemon. Failures raise ``GpuFailed`` (the
    call and the driver's error name) or ``GpuUnavailable`` (no driver / API too old).
    """

    def uses_cuda(self, pid: int) -> bool:
        """Whether ``pid`` has a CUDA context (cheap probe; False when no driver)."""
        ...

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED within ``timeout_ms`` (0: no limit in the driver; negative:
        refused). On timeout the process stays RUNNING and GpuFailed is raised (the driver's
        code: CUDA_ERROR_NOT_READY). Every call's wait is bounded by the adapter: past it,
        GpuFailed code TIMEOUT."""
        ...

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: device memory moved into the process's host memory."""
        ...

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED; ``gpu_map`` (old UUID -> new UUID) when this node's GPUs
        differ from the checkpoint's: then a pair for EVERY GPU of the dumping node, identity
        pairs included (the driver refuses an incomplete map with CUDA_ERROR_INVALID_VALUE).
        A map of identity pairs only is no remap."""
        ...

    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        ...

    def restore_thread(self, pid: int) -> int:
        """The tid of ``pid``'s CUDA restore thread (``cuCheckpointProcessGetRestoreThreadId``):
        the driver restores and unlocks on it, so it must run then (``ThreadHold``). Raises
        ``GpuFailed`` when ``pid`` has no CUDA context or the driver cannot tell."""
        ...

    def remap_refusal(self) -> str | None:
        """Why this checkpointer cannot restore onto other GPUs (bindings without the
        types, a driver older than r580, a backend that cannot); None when it can. Asked at
        restore planning, before anything is restored. Never raises."""
        ...


# ---- storage -----------------------------------------------------------------------------------


class CheckpointStore(Protocol):
    """Where checkpoints live.

    Invariants: ``list``/``get`` see a checkpoint only after ``commit`` returned, and then
    everything it needs is durable; ``abort`` and a crash before ``commit`` leave nothing
    visible; ``checkout`` yields a complete CRIU image directory or raises.
    """

    location: str

    def begin(self, checkpoint_id: str, size_hint: int = 0) -> Path:
        """A fresh empty directory for CRIU's images of ``checkpoint_id`` (about
        ``size_hint`` bytes of them, 0 if unknown)."""
        ...

    def commit(self, record: CheckpointRecord) -> CheckpointRecord:
        """Make ``record`` (and the images in its directory) durable and visible; returns the
        record with its sizes filled in."""
        ...

    def page_sink(self, checkpoint_id: str, uid: int) -> PageSink | None:
        """Where CRIU may send the pages of a begun ``checkpoint_id`` (owned by ``uid``) as it
        dumps, instead of writing pages images into its directory; None: write them there."""
        ...

    def abort(self, checkpoint_id: str) -> None:
        """Forget an uncommitted checkpoint. Idempotent."""
        ...

    def list(self) -> list[CheckpointRecord]:
        """Committed checkpoints, oldest first."""
        ...

    def get(self, checkpoint_id: str) -> CheckpointRecord: ...

    def delete(self, checkpoint_id: str) -> None: ...

    def checkout(self, checkpoint_id: str) -> AbstractContextManager[Path]:
        """A CRIU image directory for restoring ``checkpoint_id``, valid inside the context."""
        ...

    def checkout_streamed(
        self, checkpoint_id: str
    ) -> AbstractContextManager[tuple[Path, ImageSource]]:
        """For a streamed restore: an empty directory of its own (for CRIU's socket, logs
        and whatever the restore writes there) and the checkpoint's images read from the
        store as they are asked for; both valid inside the context (the store's objects are
        kept from GC meanwhile)."""
        ...

    def verify(self, checkpoint_id: str = "") -> VerifyReport:
        """Read back one checkpoint (or everything) and name every damaged object."""
        ...

    def put_group(self, group: GroupRecord) -> None:
        """Make a group checkpoint visible (after every member's checkpoint is committed);
        writing the same group twice is not an error."""
        ...

    def list_groups(self) -> builtins.list[GroupRecord]: ...

    def collect_garbage(self, delete_first: tuple[str, ...] = ()) -> GcReport:
        """Delete ``delete_first``, then every object no checkpoint needs (a dump in
        progress keeps what it wrote)."""
        ...


class Journal(Protocol):
    """Durable record of operations in flight, so a restarted daemon can finish or undo them."""

    def begin(self, op_id: str, facts: dict[str, Any]) -> None: ...

    def end(self, op_id: str) -> None: ...

    def pending(self) -> Iterator[tuple[str, dict[str, Any]]]: ...


class GuardPhase(enum.Enum):
    """Where a watched dump stands, as its guard must know it (``core.guard.verdict``)."""

    STOPPED = "stopped"
    """No checkpoint is listed: the tree is resumed if the daemon dies."""
    UNSURE = "unsure"
    """A commit (or its undo) is under way: whether the checkpoint is listed is unknown."""
    COMMITTED = "committed"
    """The checkpoint is listed: a killing dump's tree is to be killed."""


class TreeGuard(Protocol):
    """A watcher outside the daemon's process that finishes a dump's tree when the daemon
    dies in the middle of it, without waiting for a restart (docs/adr/0016).

    Invariants: the guard acts only once the daemon is dead, on exactly the processes named
    (held since identified: a pid given to another process later is never reached), and as
    ``CheckpointService.recover`` would (``core.guard``). Every call is best effort: a guard
    that cannot be reached is logged, never fails the operation (the journal still lets the
    next start recover it). Thread-safe: one op id per operation."""

    def watch(self, op_id: str, members: Sequence[Sequence[int]],
              stopped_before: frozenset[int], leave_running: bool) -> None:
        """Watch ``members`` (``[pid, start time]`` each; watched again: more members) of
        operation ``op_id``, in phase STOPPED unless told another."""
        ...

    def phase(self, op_id: str, phase: GuardPhase) -> None:
        """``op_id`` is now in ``phase``; returns once a daemon dying after it is acted on
        as this phase says."""
        ...

    def release(self, op_id: str) -> None:
        """``op_id`` ended (its tree runs, or was killed): nothing to do for it any more."""
        ...


class StdioProvider(Protocol):
    """Replacements, at restore, for stdio descriptors whose other end is outside the tree."""

    def replacements(
        self, stdio: Sequence[StdioFact], output_path: Path, owner: tuple[int, int] = (0, 0),
        chosen_by_caller: bool = False,
    ) -> AbstractContextManager[tuple[InheritFd, ...]]:
        """Descriptors to hand to CRIU; ours are closed when the context exits (the restored
        tree keeps its own copies). The output file belongs to ``owner`` (uid, gid): a path
        the caller chose is opened with the owner's file-system identity (never root's for a
        user's job), one the daemon chose is created by root and given to the owner."""
        ...

    def from_process(
        self, stdio: Sequence[StdioFact], pid: int
    ) -> AbstractContextManager[tuple[InheritFd, ...]]:
        """Replacements taken from process ``pid`` (the init of the container restored
        into): each external descriptor 0-2 becomes the same descriptor of ``pid``, reopened
        (a pipe to its runtime: the tree writes to the container's log); any other external
        one its stdout when written, /dev/null when read. Ours are closed on exit. Raises
        ProcessNotFound when ``pid`` or its descriptor is gone."""
        ...


# ---- object storage ------------------------------------------------------------------------


class BlobStore(Protocol):
    """Where the content-addressed store keeps its objects: local disk, NFS, object stores.

    Keys are ``/``-separated relative names (``packs/ab/abcd...``). Invariants: ``put`` writes
    a whole object or nothing (a reader never sees part of one); with ``if_absent`` an
    existing object is left as is and ``put`` returns False; after ``flush`` returns, every
    object put before it survives a crash of this host; ``get`` of a missing key raises
    ``BlobNotFound``; ``delete`` of a missing key is not an error.
    """

    location: str

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool: ...

    def put_parts(
        self, key: str, parts: Sequence[Buffer], *, if_absent: bool = False
    ) -> bool:
        """``put`` of the parts concatenated (a store on a file system writes them as they
        are, without joining them first)."""
        ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (``end`` None: to its end)."""
        ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        """``(key, modified time)`` of every object under ``prefix``."""
        ...

    def delete(self, key: str) -> None: ...

    def flush(self) -> None: ...


# ---- migration ---------------------------------------------------------------------------------


PlaceRun = tuple[str, int, int, int]
"""Where pages of a frame go: (image, first page in the image, first page in the frame,
count)."""


@dataclass(frozen=True)
class PageFrame:
    """Pages on the wire: ``data`` holds ``pages`` pages, a zstd frame or (``raw``) the pages
    as they are (then exactly ``pages * PAGE_SIZE`` bytes); ``runs`` say where they go. A
    frame the source's store holds is sent as it is (no recompression) when every one of its
    pages is wanted; each page is verified against the reference offered for each of its
    places before it is written there."""

    data: bytes
    pages: int
    runs: tuple[PlaceRun, ...]
    raw: bool = False

    @property
    def places(self) -> int:
        """How many page places the frame fills (a page may fill several)."""
        return sum(run[3] for run in self.runs)


@dataclass(frozen=True)
class ExportedImage:
    """One image of a checkpoint as a migration sends it. A pages image: ``refs``, every
    page's reference in the *target's* hash space (ZERO_REF for a zero page), ``pages`` of
    them not zero. Any other image: ``data``, its content as a zstd frame (as the store
    keeps it)."""

    name: str
    size: int
    refs: bytes | None = None
    pages: int = 0
    data: bytes = b""


class CheckpointExport(Protocol):
    """A committed checkpoint read from the store for another store's hash space
    (``PageExchange.export``): every page verified against this store's hash as it is read."""

    images: Sequence[ExportedImage]

    def frames(self, wanted: Mapping[str, Sequence[int]]) -> Iterator[PageFrame]:
        """Frames carrying every page place of ``wanted`` (image -> sorted page indices):
        stored frames as they are when all their pages are wanted, else frames of just the
        wanted pages. Read ahead on the store's executor."""
        ...


class FrameKeeper(Protocol):
    """Received frames kept as they are for the commit of one begun checkpoint
    (``PageExchange.frame_keeper``)."""

    def keep(self, frame: PageFrame, hashes: Sequence[bytes]) -> bool:
        """Keep ``frame`` (its pages verified: ``hashes``, in frame order) for the commit,
        which puts it in a pack as it is; False (nothing kept) when any of its pages is
        in the store or kept already, or it cannot be kept."""
        ...


class PageExchange(Protocol):
    """The page-level side of a store that a migration needs (both ends); the content store
    (``ckptd.core.store.ContentStore``) is the one implementation, tested on real backends.

    A page reference is the store's keyed hash of a page for one uid (``ZERO_REF`` for a page
    of zeros). Two daemons compare pages in the *target's* hash space: the target tells its
    seed for the uid (``page_seed``), the source hashes its pages with it."""

    @property
    def store_id(self) -> str:
        """Equal on two daemons iff they use one store (a hash of its secret, never the
        secret)."""
        ...

    def page_seed(self, uid: int) -> int: ...

    def lacks(self, uid: int, refs: Sequence[bytes]) -> list[int]:
        """Indices of ``refs`` (non-zero) whose pages the store does not hold (or holds only
        in condemned packs)."""
        ...

    def fill_pages(
        self, uid: int, path: Path, refs: Sequence[bytes], skip: frozenset[int]
    ) -> None:
        """Write at ``path`` (created, ``len(refs)`` pages, sparse) every page of ``refs`` held
        by the store except those at indices ``skip`` (written by someone else), verified."""
        ...

    def checkout(self, checkpoint_id: str) -> AbstractContextManager[Path]:
        """CRIU's image directory of a committed checkpoint, verified, removed on exit."""
        ...

    def export(self, checkpoint_id: str, seed: int) -> AbstractContextManager[CheckpointExport]:
        """A committed checkpoint's images, pages hashed with ``seed`` (another store's hash
        space), without materializing them; the store's GC waits until it closes."""
        ...

    def frame_keeper(self, checkpoint_id: str, uid: int) -> FrameKeeper | None:
        """Where the receiver of the begun ``checkpoint_id`` keeps frames for its commit;
        None when it keeps none."""
        ...


class PeerSession(Protocol):
    """One transfer to a target daemon (``PeerLink.open``)."""

    page_seed: int

    def offer_pages(self, name: str, size: int, refs: bytes, first: int = 0) -> list[int]:
        """Offer pages ``first ..`` of image ``name`` (``size`` bytes in all) by reference;
        the indices of those the target lacks. Slices go in order, from page 0."""
        ...

    def offer_file(self, name: str, data: bytes, size: int | None = None) -> None:
        """Image ``name`` whole: ``data`` is its content, or with ``size`` a zstd frame of
        its ``size`` bytes."""
        ...

    def send(self, frames: Iterator[PageFrame]) -> int:
        """Send the frames; returns the page places the target filled."""
        ...

    def finish(self, output_path: str) -> RemoteRestore:
        """The target commits the checkpoint and restores it."""
        ...

    def abort(self) -> None: ...


class PeerLink(Protocol):
    """A connection to another node's daemon (its Peer service). Errors: ``PeerError`` when it
    cannot be reached or fails; the target's own refusals as the matching ckptd errors."""

    address: str

    def probe(self, record: CheckpointRecord) -> PeerProbe: ...

    def open(self, record: CheckpointRecord, ignore_warnings: bool) -> PeerSession: ...

    def close(self) -> None: ...


class PeerConnector(Protocol):
    def connect(self, address: str) -> PeerLink:
        """A link to the daemon at ``host:port`` (mutual TLS); raises PeerError when TCP
        migration is not configured here."""
        ...


# ---- policies ----------------------------------------------------------------------------------


class PolicyRepo(Protocol):
    """Where policies survive a daemon restart. ``save`` replaces all of them atomically (a
    crash leaves the old set or the new one); ``load`` of nothing saved yet is empty."""

    def load(self) -> list[Policy]: ...

    def save(self, policies: Sequence[Policy]) -> None: ...
