"""The ckptd error tree: every failure a caller can see is one of these.

::

    CkptdError                      one line: what went wrong; what to do (``hint``)
    ├── InvalidTarget               the request names something that cannot be acted on
    │   ├── BadRequest              a field breaks the edge's rules (``transport.validate``)
    │   ├── ProcessNotFound         no such process
    │   └── TargetRefused           pid 1, the daemon or its ancestor, a kernel thread, a zombie
    ├── CheckpointNotFound          no such checkpoint id (or none for that pid / name)
    ├── PermissionDenied            the caller's uid may not act on that process / checkpoint
    ├── Busy                        another operation holds that process right now
    ├── TooManyRequests             the caller's uid is over a per-caller limit (connections,
    │                               calls, operations): retry later
    ├── PreconditionFailed          this node cannot do it now
    │   ├── PidInUse                restore: a pid of the tree is taken (running or zombie)
    │   ├── CriuUnavailable         CRIU missing, too old, or failing ``criu check``
    │   ├── GpuUnavailable          no usable NVIDIA driver / CUDA checkpoint API
    │   ├── GpuMismatch             this node's GPUs cannot take the checkpoint
    │   ├── CgroupUnavailable       restore: the tree cannot be placed in its cgroup (the
    │   │                           caller's is gone or takes no processes, no cgroup v2)
    │   └── Incompatible            restore: this node differs from the checkpoint's (CPU,
    │                               files, kernel, ...): lists every difference
    ├── GpuFailed                   a CUDA checkpoint call failed (call, error code)
    ├── CriuFailed                  CRIU ran and failed (errno, message, log tail)
    ├── PeerError                   another daemon (migration target) unreachable or failing
    ├── StoreError                  the checkpoint store failed (I/O, format)
    │   ├── CorruptCheckpoint       data does not match its hash / manifest unreadable
    │   └── BlobNotFound            an object the store expected is missing
    └── Cancelled                   the operation was interrupted (daemon shutting down)

Invariants: every error carries the pid and/or checkpoint id it concerns when there is one;
errors raised because of another exception keep it as ``__cause__`` (``raise ... from exc``);
``str(err)`` is a single line. The mapping to gRPC status codes lives in exactly one place,
``ckptd.transport.grpc.status``; nothing in ``ckptd.core`` knows about gRPC.
"""

from __future__ import annotations


class CkptdError(Exception):
    """Base of every ckptd error. ``message`` says what went wrong, ``hint`` what to do."""

    default_hint = ""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        pid: int | None = None,
        checkpoint_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = self.default_hint if hint is None else hint
        self.pid = pid
        self.checkpoint_id = checkpoint_id

    def __str__(self) -> str:
        text = self.message if not self.hint else f"{self.message}; {self.hint}"
        return " ".join(text.splitlines())


class InvalidTarget(CkptdError):
    """The request names a target that cannot be acted on."""


class BadRequest(InvalidTarget):
    """A request field breaks the rules every input is checked against at the edge
    (``ckptd.transport.validate``). ``field`` names it (``name``, ``keep``, ``--output``...)."""

    def __init__(self, message: str, *, field: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.field = field


class ProcessNotFound(InvalidTarget):
    default_hint = "check the pid with `ps -p <pid>`"


class TargetRefused(InvalidTarget):
    """A process that cannot be checkpointed as asked (pid 1, the daemon, kernel threads,
    zombies, session 0, namespaces ckptd cannot take, an io_uring, a TCP peer outside the
    tree, a written file over the capture limit): refused before anything is touched."""


class CheckpointNotFound(CkptdError):
    default_hint = "run `ckptctl list` to see the checkpoints"


class PermissionDenied(CkptdError):
    default_hint = "run as the process owner or as root"

    def __init__(self, message: str, **kwargs: object) -> None:
        if not message.startswith("permission denied"):
            message = f"permission denied: {message}"
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class Busy(CkptdError):
    default_hint = "wait for the running operation to finish, then retry"


class TooManyRequests(CkptdError):
    """The caller's uid is over one of its limits (``max_*_per_uid`` in the daemon's config):
    refused at once, nothing done; other callers (root's above all) are not held up."""

    default_hint = "wait for your running requests to end, then retry"


class PreconditionFailed(CkptdError):
    """This node cannot perform the operation in its current state."""


class PidInUse(PreconditionFailed):
    """A pid the restore needs is taken."""


class CriuUnavailable(PreconditionFailed):
    default_hint = "run scripts/install-criu.sh (needs CRIU >= 4.1) or set criu_path in the config"


class GpuUnavailable(PreconditionFailed):
    """No usable NVIDIA driver / CUDA checkpoint API where one is needed."""


class GpuMismatch(PreconditionFailed):
    """This node's GPUs cannot take the checkpoint (model, count, memory, driver).
    ``problems`` lists every blocking difference, one per item."""

    def __init__(self, message: str, *, problems: tuple[str, ...] = (), **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.problems = problems or (message,)


class CgroupUnavailable(PreconditionFailed):
    """A restored tree cannot be placed in the cgroup it belongs in (the caller's, or one of
    its own): that cgroup is gone, takes no processes (cgroup v2 allows them only where no
    child cgroup has controllers enabled), or cannot be told (no cgroup v2 hierarchy, a
    process outside the daemon's cgroup namespace)."""


class PathChanged(PreconditionFailed):
    """A path CRIU resolves by path as root, for the restored tree, leads elsewhere than the
    object ckptd checked (a link or a swapped directory on the way), or CRIU would create a
    file in a directory someone but root can change: the restore is refused, or undone
    before the tree runs."""


class Incompatible(PreconditionFailed):
    """This node cannot take the checkpoint as it is: ``blocking`` differences (never
    overridable) and ``warnings`` (a restore may be told to ignore them)."""

    def __init__(
        self,
        message: str,
        *,
        blocking: tuple[str, ...] = (),
        warnings: tuple[str, ...] = (),
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.blocking = blocking
        self.warnings = warnings


class GpuFailed(CkptdError):
    """A CUDA checkpoint call failed. ``call`` is the driver function, ``code`` its error."""

    def __init__(self, message: str, *, call: str = "", code: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.call = call
        self.code = code


class CriuFailed(CkptdError):
    """CRIU ran and reported failure. ``log_tail`` holds the last lines of its log."""

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        log_tail: str = "",
        log_path: str | None = None,
        hint: str | None = None,
        pid: int | None = None,
        checkpoint_id: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint, pid=pid, checkpoint_id=checkpoint_id)
        self.errno = errno
        self.log_tail = log_tail
        self.log_path = log_path

    def __str__(self) -> str:
        base = super().__str__()
        last = _last_error_line(self.log_tail)
        if last:
            base = f"{base} (criu: {last})"
        return base


class PeerError(CkptdError):
    """Another daemon could not be reached (address, TLS) or failed part-way. ``address`` is
    the peer's host:port; ``in_doubt``: the link broke while the peer was acting, so whether
    it acted is unknown."""

    def __init__(
        self, message: str, *, address: str = "", in_doubt: bool = False, **kwargs: object
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.address = address
        self.in_doubt = in_doubt


class StoreError(CkptdError):
    """The checkpoint store failed."""


class CorruptCheckpoint(StoreError):
    default_hint = "run `ckptctl verify` and restore from another checkpoint"


class Cancelled(CkptdError):
    default_hint = "retry when the daemon is running again"


def _last_error_line(log_tail: str) -> str:
    """The most telling line of a CRIU log tail: its last "Error" line, else its last line."""
    lines = [
        ln.strip() for ln in log_tail.splitlines() if ln.strip() and "RLIMIT_NOFILE" not in ln
    ]
    lines = [ln for ln in lines if not ln.endswith(("Dumping FAILED.", "Restoring FAILED."))]
    errors = [ln for ln in lines if "Error" in ln]
    if errors:
        return errors[-1]
    return lines[-1] if lines else ""


class BlobNotFound(StoreError):
    """An object the store expected is missing from its backend."""
