"""CRIU's log, read in one place: its tail, its first error, and the failure they make.

CRIU writes a log per run (``dump.log``, ``restore.log``) and a few lines on stderr. What
ckptd tells a user of a failed CRIU is read from there: the last lines (``log_tail``), the
first error that is not CRIU's closing summary (``first_error``), and the cause a user can act
on (``causes.explain``), composed into one ``CriuFailed`` by ``failure``.

Invariant: lines in ``HARMLESS`` (notices CRIU prints and carries on after) are never taken
for the cause of a failure nor shown in a tail; reading a log never raises (a missing or
unreadable log reads as empty).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckptd.adapters.criu.causes import explain
from ckptd.errors import CriuFailed

LOG_TAIL_LINES = 25
HARMLESS = (
    "RLIMIT_NOFILE",  # CAP_SYS_RESOURCE missing: CRIU says so and carries on
    "tun: Unable to create tun",  # kerndat's probe inside a container without /dev/net/tun
    # a restore inside a container unlocks the nftables table CRIU made in the old one's
    # network namespace, which the new one does not have
    "Could not process rule: No such file or directory",
    "delete table inet CRIU-",
)

_ERROR_RE = re.compile(r"\bError \([^)]*\):\s*(.*)$")
_SUMMARY = ("Dumping FAILED.", "Restoring FAILED.")  # CRIU's last words, not a cause


def is_harmless(line: str) -> bool:
    return any(h in line for h in HARMLESS)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a CRIU log, harmless noise left out."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if not is_harmless(ln)]
    return "\n".join(kept[-lines:])


def log_tail_text(text: str, lines: int = 5) -> str:
    """The last ``lines`` non-blank lines of CRIU's output ``text`` on one line, ``|`` between."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    kept = [ln for ln in kept if not is_harmless(ln)]
    return " | ".join(kept[-lines:])


def first_error(path: Path) -> str:
    """The text of the first error in a CRIU log that is neither harmless nor CRIU's final
    "Dumping FAILED." summary (e.g. "unix: External socket is used. ..."); "" if none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        match = _ERROR_RE.search(line)
        if match and not is_harmless(line) and match[1].strip() not in _SUMMARY:
            return match[1].strip()
    return ""


def first_error_line(path: Path, stderr: str) -> str:
    """The first whole line of a CRIU run on the command line (its log, then its stderr)
    that says ``Error`` and is not the RLIMIT_NOFILE or tun notice; "" if none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in [*lines, *stderr.splitlines()]:
        if "Error" in line and "RLIMIT_NOFILE" not in line and "tun:" not in line:
            return line.strip()
    return ""


def failure(
    what: str, log_path: Path, pid: int | None, *, errno: int | None, errmsg: str,
    hook_error: BaseException | None, ghost_limit: int | None,
) -> CriuFailed:
    """The one error for CRIU's failed ``what`` (``"dump of pid 42"``): aborted by a hook
    (``hook_error``, to be raised from it), a cause ``explain`` recognises, or CRIU's first
    error. ``errmsg`` is CRIU's *first* error (its ``cr_errmsg``); when that is a harmless
    notice the first other error of the log is the detail."""
    tail = log_tail(log_path)
    detail = errmsg if errmsg and not is_harmless(errmsg) else ""
    detail = detail or first_error(log_path)
    detail = detail or (os.strerror(errno) if errno else "see its log")
    if hook_error is not None:
        return CriuFailed(
            f"CRIU {what} aborted: {hook_error}", errno=errno, log_tail=tail,
            log_path=str(log_path), pid=pid, hint=f"see {log_path}",
        )
    cause = explain(what, f"{detail}\n{tail}", pid, ghost_limit=ghost_limit)
    if cause is not None:  # a cause the user can act on, CRIU's words kept in the tail
        return CriuFailed(
            cause.message, errno=errno, log_tail=tail, log_path=str(log_path), pid=pid,
            hint=f"{cause.hint} (CRIU's log: {log_path})",
        )
    return CriuFailed(
        f"CRIU {what} failed: {detail}", errno=errno, log_tail=tail,
        log_path=str(log_path), pid=pid, hint=f"see {log_path}",
    )


def exited_silently(what: str, log_path: Path, pid: int | None) -> CriuFailed:
    """CRIU's socket closed before it answered the request."""
    return CriuFailed(
        f"CRIU {what} failed: CRIU exited without answering",
        log_tail=log_tail(log_path), log_path=str(log_path), pid=pid,
        hint=f"see {log_path}",
    )
