"""Issue 21 (11e): a dump refused for want of CAP_SYS_RESOURCE names it and says what to do."""

from __future__ import annotations

from pathlib import Path

from ckptd.adapters.criu.causes import explain

RLIMIT_LOG = (
    "Can't get rlimit 0: Operation not permitted\n"
    "(00.050046) Error (criu/cr-dump.c:1584): Dump core (pid: 23189) failed with -1"
)


def test_an_rlimit_refused_by_the_kernel_names_cap_sys_resource(tmp_path: Path) -> None:
    cause = explain("dump of pid 23189", RLIMIT_LOG, 23189, tmp_path)
    assert cause is not None
    assert cause.message.startswith("CRIU dump of pid 23189 failed: ")
    assert "CAP_SYS_RESOURCE" in cause.message
    assert "rlimit" in cause.message and "not permitted" in cause.message
    assert "CAP_SYS_RESOURCE" in cause.hint and "CapabilityBoundingSet" in cause.hint
    assert "\n" not in cause.message + cause.hint


def test_missing_capabilities_name_cap_sys_resource_too(tmp_path: Path) -> None:
    cause = explain("dump of pid 5", "Effective capability 21 missing", 5, tmp_path)
    assert cause is not None
    assert "CAP_SYS_ADMIN" in cause.message and "CAP_SYS_RESOURCE" in cause.message
    assert "--cap-add" in cause.hint


def test_criu_s_harmless_rlimit_nofile_notice_is_no_such_cause(tmp_path: Path) -> None:
    text = ("Warn: Can't set RLIMIT_NOFILE: Operation not permitted\n"
            "Error (x): something else")
    assert explain("dump of pid 5", text, 5, tmp_path) is None


def test_a_listening_socket_with_connections_not_yet_accepted_says_what_to_do(
        tmp_path: Path) -> None:
    """Issue 34 (7): what a CRIU that ignores ``tcp_skip_in_flight`` says, told as the cause."""
    text = ("(00.012) Error (criu/sk-inet.c:185): In-flight connection (l) for 5d3a\n"
            "(00.012) Error (criu/sk-inet.c:186): In-flight connections can be ignored with "
            "the --skip-in-flight option.")
    cause = explain("dump of pid 42", text, 42, tmp_path)
    assert cause is not None
    assert cause.message.startswith("CRIU dump of pid 42 failed: a listening TCP socket")
    assert "not accepted yet" in cause.message and "tcp_skip_in_flight" in cause.message
    assert "ckptctl check" in cause.hint and "\n" not in cause.message + cause.hint
