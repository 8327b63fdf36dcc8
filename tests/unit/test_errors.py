"""The error tree: one-line messages with hints, CRIU log tails, the hierarchy."""

from __future__ import annotations

import pytest

from ckptd import errors
from ckptd.errors import (
    Busy,
    CheckpointNotFound,
    CkptdError,
    CorruptCheckpoint,
    CriuFailed,
    CriuUnavailable,
    InvalidTarget,
    PermissionDenied,
    PidInUse,
    PreconditionFailed,
    ProcessNotFound,
    StoreError,
    TargetRefused,
)


def test_str_is_one_line_with_the_hint() -> None:
    err = CkptdError("first line\nsecond line", hint="do this\nthen that", pid=4)
    assert str(err) == "first line second line; do this then that"
    assert err.message == "first line\nsecond line"
    assert (err.pid, err.checkpoint_id) == (4, None)


@pytest.mark.parametrize(
    ("cls", "hint"),
    [
        (ProcessNotFound, "check the pid with `ps -p <pid>`"),
        (CheckpointNotFound, "run `ckptctl list` to see the checkpoints"),
        (PermissionDenied, "run as the process owner or as root"),
        (Busy, "wait for the running operation to finish, then retry"),
        (CorruptCheckpoint, "run `ckptctl verify` and restore from another checkpoint"),
    ],
)
def test_default_hints(cls: type[CkptdError], hint: str) -> None:
    err = cls("it broke")
    assert err.hint == hint
    prefix = "permission denied: " if cls is PermissionDenied else ""
    assert str(err) == f"{prefix}it broke; {hint}"


def test_an_explicit_empty_hint_drops_the_default() -> None:
    assert str(ProcessNotFound("gone", hint="")) == "gone"
    assert str(CkptdError("plain")) == "plain"


def test_hierarchy() -> None:
    assert issubclass(ProcessNotFound, InvalidTarget)
    assert issubclass(TargetRefused, InvalidTarget)
    assert issubclass(PidInUse, PreconditionFailed)
    assert issubclass(CriuUnavailable, PreconditionFailed)
    assert issubclass(CorruptCheckpoint, StoreError)
    public = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, Exception)
        and obj.__module__ == errors.__name__
    ]
    assert all(issubclass(cls, CkptdError) for cls in public)


LOG_TAIL = """(00.001) Dumping pid 10
(00.002) Error (criu/files.c:12): first problem
(00.003) Warn  (criu/mem.c:3): meh
(00.004) Error (criu/cr-dump.c:99): Dumping FAILED.
(00.005) Error (criu/rlimit.c:40): rlimit: Can't setup RLIMIT_NOFILE for self: EPERM
(00.006) Unlock network
"""


def test_criu_failed_str_has_the_last_error_line_not_rlimit() -> None:
    err = CriuFailed("CRIU dump of pid 10 failed: boom", log_tail=LOG_TAIL, hint="see dump.log")
    text = str(err)
    assert text == (
        "CRIU dump of pid 10 failed: boom; see dump.log "
        "(criu: (00.002) Error (criu/files.c:12): first problem)"
    )
    assert "RLIMIT_NOFILE" not in text
    assert "\n" not in text


def test_criu_failed_without_error_lines_uses_the_last_line() -> None:
    err = CriuFailed("failed", log_tail="(00.1) one\n(00.2) two\n\n", hint="")
    assert str(err) == "failed (criu: (00.2) two)"


def test_criu_failed_without_a_log() -> None:
    err = CriuFailed("failed", errno=5, hint="")
    assert str(err) == "failed"
    assert (err.errno, err.log_tail, err.log_path) == (5, "", None)


def test_criu_failed_ignores_an_rlimit_line_even_as_the_last_line() -> None:
    tail = "(00.1) Dumping finished\n(00.2) Error (criu/rlimit.c:40): Can't setup RLIMIT_NOFILE"
    assert "RLIMIT_NOFILE" not in str(CriuFailed("failed", log_tail=tail))


def test_str_is_one_line_with_crlf() -> None:
    text = str(CkptdError("criu said:\r\nno", hint="retry\r"))
    assert len(text.splitlines()) == 1
