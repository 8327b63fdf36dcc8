"""The CRIU port: the jobs a dump or restore is, its hooks, where CRIU runs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from ckptd.domain import CriuStatus, TcpConnection
from ckptd.errors import CkptdError


class CriuCreates(NamedTuple):
    """A path CRIU creates (or removes) by path, as root, at a restore."""

    path: str
    what: str
    """"ghost file", "ghost directory", "link-remap file", "unix socket"."""
    owner: int = -1
    """A uid whose own directories may hold it as well as root's (a unix socket's owner: a
    socket file holds no content, and Python's forkserver and multiprocessing managers keep
    theirs in the job owner's ``/tmp/pymp-*``); -1: root's directories alone."""


RELINKS_IMAGE = "ckptd-relinks.json"
"""ckptd's own file among a checkpoint's images: each link-remap file's ``linked_as``."""


class CriuRelink(NamedTuple):
    """A deleted file CRIU's dump linked back (it was still linked elsewhere): CRIU made
    ``remap`` (``link_remap.N`` beside it) a hard link of it; its restore links ``remap`` at
    ``deleted``, opens it there and removes both names."""

    remap: str
    deleted: str
    linked_as: str = ""
    """The name the object is still linked as in ``remap``'s directory (a spawn-context
    semaphore's ``/dev/shm/sem.mp-*``), recorded at the dump; "" when none was found."""


def encode_relinks(relinks: Iterable[CriuRelink]) -> bytes:
    """``RELINKS_IMAGE``'s content: each link-remap file's ``linked_as`` (those found)."""
    found = {r.remap: r.linked_as for r in relinks if r.linked_as}
    return json.dumps({"linked_as": found}, sort_keys=True).encode()


def decode_relinks(raw: bytes) -> dict[str, str]:
    """link-remap file -> ``linked_as``, from ``RELINKS_IMAGE``'s content. Raises
    ValueError for anything else."""
    try:
        found = json.loads(raw)["linked_as"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not ckptd's {RELINKS_IMAGE}") from exc
    if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise ValueError(f"not ckptd's {RELINKS_IMAGE}")
    return found


@dataclass(frozen=True)
class CriuPaths:
    """What CRIU resolves by path, as root, when it restores a checkpoint (read from its
    images by ``Criu.restore_paths``). ``opened``: every object it reopens for the tree —
    regular files open or mapped, executables, working and root directories, named FIFOs,
    the link-remap files it reopens for deleted ones; ``created``: every path it creates for
    the tree — ghost files (the content of deleted files), bound unix sockets. Absolute paths
    as the tree sees them (a container's root for a restore into one)."""

    opened: tuple[str, ...] = ()
    created: tuple[CriuCreates, ...] = ()
    relinks: tuple[CriuRelink, ...] = ()
    """Every link-remap file CRIU opens, with the deleted name it links it at (its
    ``opened`` and ``created`` entries are there as well)."""


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

    def names(self) -> list[str]:
        """Every image of the checkpoint, sorted."""
        ...

    def pages(self, name: str, first: int, count: int) -> bytes | memoryview:
        """Pages ``first`` to ``first + count - 1`` of the pages image ``name``, verified
        (a lazy restore asks for them in any order, neighbours one after another); raises
        CorruptCheckpoint before returning anything unverified, IndexError past the end. A
        memoryview is valid until the next call."""
        ...


class LazyPages(Protocol):
    """The end of a lazy restore (``CriuRestoreJob.lazy``), told from a thread of the
    adapter: the tree runs once CRIU returns, and its remaining pages are served from
    ``CriuRestoreJob.images`` as it touches them and in the background until all are in."""

    def started(self, helper_pid: int) -> None:
        """CRIU's page daemon for the restore runs as ``helper_pid`` (before the restore
        begins): killed after the tree if the restore is undone by a later start."""

    def failed(self, error: CkptdError) -> None:
        """A page cannot be served (damaged or missing, or CRIU's page daemon ended first).
        Called while every process that touched a missing page still waits for it, before
        anything lets that wait end: it must kill the restored tree and return only once the
        tree is dead (the wait would otherwise end on a zero page)."""

    def done(self, pages: int, seconds: float) -> None:
        """Every page was served (``pages`` of them, ``seconds`` after CRIU returned)."""


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
    lazy: LazyPages | None = None
    """With ``images``: a lazy restore. CRIU restores the tree without its anonymous
    private memory (only the pages it reads itself: stacks, file mappings, shared memory),
    the tree runs when CRIU returns, and every other page is served from ``images``,
    verified, when first touched (userfaultfd) or fetched in the background; ``lazy`` is
    told how that ends. Not with ``container``."""


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

    def restore_paths(self, images_dir: Path, images: ImageSource | None) -> CriuPaths:
        """What CRIU will resolve by path, as root, restoring these images (in
        ``images_dir``, or streamed from ``images``). Raises CorruptCheckpoint when they
        cannot be read."""
        ...

    def lost_locks(self, images_dir: Path) -> tuple[str, ...]:
        """The file locks of a dump (its images in ``images_dir``) that a restore will not
        take back, one line each naming the file, the process and the lock; () when none, or
        when the images do not say (a warning only)."""
        ...

    def can_stream_restore(self) -> bool:
        """Whether ``restore`` takes ``CriuRestoreJob.images`` (a CRIU that streams images
        through its RPC service)."""
        ...
