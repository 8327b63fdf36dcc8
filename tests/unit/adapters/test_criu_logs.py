"""CRIU's log read in one place (adapters/criu/logs.py): what a failed CRIU is said as."""

from __future__ import annotations

import errno
from pathlib import Path

from ckptd.adapters.criu.logs import (
    failure,
    first_error,
    first_error_line,
    log_tail,
    log_tail_text,
)

LOG = """\
(00.000010) Warn  (criu/kerndat.c:1): Error (criu/util.c:1): RLIMIT_NOFILE can't be raised
(00.000020) Info: collecting
(00.000030) Error (criu/sk-unix.c:1): unix: External socket is used. Consider --ext-unix-sk
(00.000040) Error (criu/cr-dump.c:2): Dumping FAILED.
"""


def _log(tmp_path: Path, text: str = LOG) -> Path:
    path = tmp_path / "dump.log"
    path.write_text(text)
    return path


def test_the_first_error_is_neither_a_harmless_notice_nor_the_summary(tmp_path: Path) -> None:
    assert first_error(_log(tmp_path)) == (
        "unix: External socket is used. Consider --ext-unix-sk")
    assert first_error(_log(tmp_path, "(0.1) Error (x.c:1): Dumping FAILED.\n")) == ""
    assert first_error(tmp_path / "missing.log") == ""


def test_the_tail_leaves_harmless_notices_out(tmp_path: Path) -> None:
    tail = log_tail(_log(tmp_path), lines=2)
    assert tail.splitlines() == LOG.splitlines()[2:]
    assert "RLIMIT_NOFILE" not in log_tail(_log(tmp_path))
    assert log_tail(tmp_path / "missing.log") == ""
    assert log_tail_text("a\n\n RLIMIT_NOFILE x\n b \nc\n", lines=2) == "b | c"


def test_a_command_line_run_s_first_error_line(tmp_path: Path) -> None:
    assert first_error_line(_log(tmp_path), "") == LOG.splitlines()[2]
    assert first_error_line(tmp_path / "missing.log", "Error: from stderr\n") == (
        "Error: from stderr")


def test_a_failure_names_the_cause_a_user_can_act_on(tmp_path: Path) -> None:
    log = _log(tmp_path)
    err = failure("dump of pid 42", log, 42, errno=None, errmsg="", hook_error=None,
                  ghost_limit=None)
    assert err.message.startswith("CRIU dump of pid 42 failed: the tree has a Unix socket")
    assert err.log_path == str(log) and err.pid == 42 and str(log) in err.hint
    assert "External socket" in err.log_tail


def test_a_failure_without_a_known_cause_keeps_criu_s_words(tmp_path: Path) -> None:
    log = _log(tmp_path, "(0.1) Error (x.c:1): RLIMIT_NOFILE notice\n(0.2) Error (y.c:2): boom\n")
    harmless_first = failure("restore", log, None, errno=None,
                             errmsg="RLIMIT_NOFILE notice", hook_error=None, ghost_limit=None)
    assert harmless_first.message == "CRIU restore failed: boom"
    given = failure("restore", log, None, errno=None, errmsg="its own words",
                    hook_error=None, ghost_limit=None)
    assert given.message == "CRIU restore failed: its own words"
    empty = failure("restore", _log(tmp_path, ""), None, errno=errno.EPERM, errmsg="",
                    hook_error=None, ghost_limit=None)
    assert empty.message == "CRIU restore failed: Operation not permitted"
    assert empty.errno == errno.EPERM


def test_a_hook_s_error_is_the_message_of_an_aborted_call(tmp_path: Path) -> None:
    err = failure("dump of pid 7", _log(tmp_path), 7, errno=None, errmsg="",
                  hook_error=RuntimeError("store full"), ghost_limit=None)
    assert err.message == "CRIU dump of pid 7 aborted: store full"
