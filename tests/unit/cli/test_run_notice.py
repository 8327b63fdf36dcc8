"""``ckptctl run``'s own lines (checkpointed, drained) reach the user, not the job's stderr
file: a restore puts that file back to its content at the checkpoint, so a line written there
after it survived only in the copy kept aside (issue 24, 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NOTICE = "from ckptd.transport.cli.run import notice; notice('job checkpointed as ck-1')"


def test_a_notice_skips_a_stderr_file_for_stdout_when_that_is_not_a_file(tmp_path: Path) -> None:
    with open(tmp_path / "job.err", "wb") as job_err:
        done = subprocess.run([sys.executable, "-c", NOTICE], stdout=subprocess.PIPE,
                              stderr=job_err, stdin=subprocess.DEVNULL, check=True,
                              start_new_session=True)
    assert done.stdout == b"ckptctl: job checkpointed as ck-1\n"
    assert (tmp_path / "job.err").read_bytes() == b""


def test_a_notice_goes_to_stderr_when_it_is_not_a_file() -> None:
    done = subprocess.run([sys.executable, "-c", NOTICE], capture_output=True, check=True)
    assert done.stderr == b"ckptctl: job checkpointed as ck-1\n" and done.stdout == b""


def test_with_both_in_files_and_no_terminal_it_still_says_it_on_stderr(tmp_path: Path) -> None:
    with open(tmp_path / "job.out", "wb") as out, open(tmp_path / "job.err", "wb") as err:
        subprocess.run([sys.executable, "-c", NOTICE], stdout=out, stderr=err,
                       stdin=subprocess.DEVNULL, check=True, start_new_session=True)
    assert (tmp_path / "job.err").read_bytes() == b"ckptctl: job checkpointed as ck-1\n"
