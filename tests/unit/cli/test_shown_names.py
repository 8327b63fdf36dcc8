"""Issue 33 (6): names a user chose (a file named with a newline or a terminal escape) never
reach ckptctl's human output raw: paths are quoted like a Python string, an event's message
has its control characters escaped; each stays one line."""

from __future__ import annotations

from ckptd.transport.cli.jobs import event_line
from ckptd.transport.cli.render import escaped, restore_summary, shown_path

ODD = "/tmp/shared/odd\nname.log.ckptd-r1"
ESCAPE = "/tmp/shared/\x1b[2J.log"


def test_a_path_that_does_not_print_is_quoted() -> None:
    assert shown_path("/tmp/job.log.ckptd-r1") == "/tmp/job.log.ckptd-r1"
    assert shown_path("/tmp/a b/é.log") == "/tmp/a b/é.log"
    assert shown_path(ODD) == "'/tmp/shared/odd\\nname.log.ckptd-r1'"
    assert shown_path(ESCAPE) == "'/tmp/shared/\\x1b[2J.log'"
    assert shown_path("/tmp/it's") == '"/tmp/it\'s"'  # a quote: quoted, not ambiguous
    assert shown_path("/tmp/bad\udcff") == "'/tmp/bad\\udcff'"  # a byte that is no UTF-8


def test_a_restore_summary_keeps_one_line_per_file() -> None:
    text = restore_summary({"id": "ck-20260101T000000-abcdef", "pid": 7, "duration_s": 1.0,
                            "files_put_back": ["/tmp/shared/odd\nname.log"],
                            "files_kept": [ODD]})
    assert text.splitlines()[1:] == ["put back: '/tmp/shared/odd\\nname.log' (as at the "
                                     "checkpoint)",
                                     f"kept: {shown_path(ODD)} (the version found on disk)"]


def test_an_events_message_is_one_line_with_its_control_characters_escaped() -> None:
    line = event_line({"time": 0.0, "kind": "restore", "name": "", "pid": 7,
                       "checkpoint_id": "", "message": f"put back {ODD} and {ESCAPE}"})
    assert "\n" not in line and "\x1b" not in line
    assert line.endswith("put back /tmp/shared/odd\\nname.log.ckptd-r1 and "
                         "/tmp/shared/\\x1b[2J.log")
    assert escaped("plain é") == "plain é"
