"""Issue 21 (11c): a file system gone read-only under the daemon is one line naming the
directory and what to do, not `internal error: [Errno 30] ...`."""

from __future__ import annotations

import errno
import os

import grpc

from ckptd.transport.grpc.status import code_for, details_for


def test_a_read_only_state_dir_is_one_line_naming_it_and_what_to_do() -> None:
    exc = OSError(errno.EROFS, "Read-only file system", "/var/lib/ckptd/state/work/ck-1")
    line = details_for(exc)
    assert line.startswith("the daemon cannot write in /var/lib/ckptd/state/work ")
    assert "make it writable" in line and "--state-dir" in line
    assert "Errno" not in line and "internal error" not in line and "\n" not in line
    assert code_for(exc) is grpc.StatusCode.INTERNAL


def test_a_read_only_error_behind_another_is_found() -> None:
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/s/journal/.x.tmp")
        except OSError as inner:
            raise RuntimeError("journal write failed") from inner
    except RuntimeError as exc:
        assert details_for(exc).startswith("the daemon cannot write in /s/journal ")


def test_a_full_state_dir_is_one_line_naming_it_and_what_to_do() -> None:
    """Issue 33 (7): a full state dir (or quota) came back `internal error: [Errno 28] ...`."""
    for code, why, todo in ((errno.ENOSPC, "its file system is full", "free space there"),
                            (errno.EDQUOT, "the disk quota is exceeded", "raise the quota")):
        exc = OSError(code, os.strerror(code), "/var/lib/ckptd/state/journal/.op.tmp")
        line = details_for(exc)
        assert line.startswith(f"the daemon cannot write in /var/lib/ckptd/state/journal "
                               f"({why}); "), line
        assert todo in line and "--state-dir" in line
        assert "Errno" not in line and "internal error" not in line and "\n" not in line


def test_other_os_errors_stay_internal_errors() -> None:
    line = details_for(OSError(errno.EIO, "Input/output error", "/x/y"))
    assert line.startswith("internal error: [Errno 5]")
