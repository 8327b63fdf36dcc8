"""The one place where ckptd errors become gRPC status codes.

| ckptd error                         | gRPC code            |
|-------------------------------------|----------------------|
| ProcessNotFound, CheckpointNotFound | NOT_FOUND            |
| InvalidTarget, TargetRefused,       | INVALID_ARGUMENT     |
| BadRequest                          |                      |
| PermissionDenied                    | PERMISSION_DENIED    |
| Busy                                | ABORTED              |
| TooManyRequests                     | RESOURCE_EXHAUSTED   |
| PreconditionFailed (PidInUse, CRIU) | FAILED_PRECONDITION  |
| CorruptCheckpoint                   | DATA_LOSS            |
| Cancelled                           | CANCELLED            |
| PeerError                           | UNAVAILABLE          |
| CriuFailed, StoreError, anything    | INTERNAL             |
"""

from __future__ import annotations

import errno
import logging
import os
from typing import NoReturn

import grpc

from ckptd import errors
from ckptd.transport.metadata import ERROR_KIND_KEY as ERROR_KIND_KEY  # noqa: PLC0414

log = logging.getLogger("ckptd.transport.grpc")

_CODES: tuple[tuple[type[errors.CkptdError], grpc.StatusCode], ...] = (
    (errors.ProcessNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.CheckpointNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidTarget, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Busy, grpc.StatusCode.ABORTED),
    (errors.TooManyRequests, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CorruptCheckpoint, grpc.StatusCode.DATA_LOSS),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.PeerError, grpc.StatusCode.UNAVAILABLE),
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str) -> errors.CkptdError:
    """The ckptd error a status from another daemon stands for (the table read backwards;
    codes no ckptd error maps to become PeerError). ``details`` already carries its hint."""
    for kind, mapped in _CODES:
        if mapped is code:
            return kind(details, hint="")
    return errors.PeerError(details, hint="")


def details_for(exc: BaseException) -> str:
    """One line for the caller: ckptd errors say themselves; a file system gone read-only or
    full under the daemon says which directory and what to do; others are internal errors."""
    if isinstance(exc, errors.CkptdError):
        return str(exc)
    unwritable = _cannot_write(exc)
    if unwritable is not None:
        where = os.path.dirname(os.fsdecode(unwritable.filename)) or "its state dir"
        why, todo = _CANNOT_WRITE[unwritable.errno or 0]
        return (f"the daemon cannot write in {where} ({why}); {todo}, or point the daemon's "
                "--state-dir elsewhere (--store if it is the store's)")
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"internal error: {text}; see the daemon's log (journalctl -u ckptd)"


_CANNOT_WRITE = {
    errno.EROFS: ("read-only file system", "make it writable"),
    errno.ENOSPC: ("its file system is full", "free space there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there or raise the quota"),
}
"""Why the daemon cannot write where its own files are, and what to do: one line each."""


def _cannot_write(exc: BaseException) -> OSError | None:
    """The EROFS, ENOSPC or EDQUOT error (with a file name) ``exc`` is or was caused by."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _CANNOT_WRITE and seen.filename:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def abort_with(context: grpc.ServicerContext, exc: BaseException, what: str) -> NoReturn:
    """End the call with ``exc``'s code and one-line message (marked as the daemon's own
    answer); internal errors are logged with their traceback, refusals as a line."""
    code = code_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", what, exc, exc_info=exc)
    else:
        log.info("%s refused: %s", what, exc)
    context.set_trailing_metadata(((ERROR_KIND_KEY, type(exc).__name__),))
    context.abort(code, details_for(exc))
    raise AssertionError("unreachable: abort raises")
