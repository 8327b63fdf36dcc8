"""Each kind of stdout a job may have comes back after a restore, and the job goes on.

- a pipe to a launcher outside the tree: the restore's output file takes its place;
- a regular file: reopened at its path and offset, the job keeps writing where it was;
- /dev/null: restored as it was;
- a terminal (a shell job on a pty): a new pty whose output ckptd relays to the output file;
- not a session or group leader (``sh -c 'prog > FILE &'``, the scheduler case).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_running,
    assert_same_lines,
    io_wchar,
    proc_state,
    read_lines_file,
    reference,
    spawn_shell_job_on_pty,
    stat_fields,
    wait_for_done,
    wait_for_lines,
    wait_state,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

STEPS = 40
INTERVAL = 30


def stdio_of(record: dict[str, object], fd: int) -> dict[str, str]:
    for fact in record["stdio"]:  # type: ignore[attr-defined]
        if fact["fd"] == fd and fact["pid"] == record["pid"]:
            return fact  # type: ignore[no-any-return]
    raise AssertionError(f"no stdio fact for fd {fd} in {record['stdio']}")


def test_stdout_on_a_pipe_goes_to_the_output_file(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    with open(tmp_path / "stderr", "wb") as err:
        proc = procs.popen(
            with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    reader.read_lines(4)
    ck = assert_ok(daemon.ctl("dump", proc.pid), "dump")
    out = stdio_of(ck, 1)
    assert out["kind"] == "pipe" and "output file" in out["on_restore"], out
    pre = reader.read_to_eof()
    proc.wait(timeout=10)

    wanted = tmp_path / "restored.out"
    res = assert_ok(daemon.ctl("restore", ck["id"], "--output", wanted), "restore")
    procs.add(res["pid"])
    assert Path(res["output_path"]) == wanted
    post = wait_for_done(wanted)
    assert_continuity(pre, post, ref)


@pytest.mark.parametrize("mode", ["append", "truncate"])
def test_stdout_on_a_regular_file_continues_in_that_file(
    daemon: Daemon, procs: Procs, tmp_path: Path, mode: str
) -> None:
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    out_path = tmp_path / "job.out"
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "append" else os.O_TRUNC)
    fd = os.open(out_path, flags, 0o644)
    try:
        proc = procs.popen(
            with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=fd,
            stderr=subprocess.DEVNULL,
        )
    finally:
        os.close(fd)
    wait_for_lines(out_path, 4)
    ck = assert_ok(daemon.ctl("dump", proc.pid), "dump")
    out = stdio_of(ck, 1)
    assert out["kind"] == "file" and out["target"] == str(out_path), out
    proc.wait(timeout=10)
    pre = read_lines_file(out_path)

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert res["output_path"] == "", "nothing needed replacing: no output file"
    lines = wait_for_done(out_path)
    assert_continuity(pre, lines[len(pre) :], ref)
    assert lines == ref
    assert out_path.read_text() == "".join(f"{line}\n" for line in ref)


def test_stdout_on_dev_null_restores_runs_and_exits_0(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """The tree is ``sh`` + the workload; sh writes the workload's exit status to a file."""
    rc_file = tmp_path / "rc"
    script = '"$@" >/dev/null; echo $? > "$RC_FILE"'
    cmd = workload("counter", "--steps", 60, "--interval-ms", INTERVAL)
    sh = procs.popen(
        ["sh", "-c", script, "sh", *cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, "RC_FILE": str(rc_file)},
    )
    wait_until(lambda: len(Path(f"/proc/{sh.pid}/task/{sh.pid}/children").read_text()
                          .split()) == 1, 10, "sh to start the workload")
    worker = int(Path(f"/proc/{sh.pid}/task/{sh.pid}/children").read_text().split()[0])
    wait_until(lambda: io_wchar(worker) > 0, 10, "the workload to write")
    time.sleep(0.1)

    ck = assert_ok(daemon.ctl("dump", sh.pid), "dump")
    assert [p["pid"] for p in ck["processes"]] == [sh.pid, worker]
    assert stdio_of({"pid": worker, "stdio": ck["stdio"]}, 1)["kind"] == "devnull"
    sh.wait(timeout=10)
    wait_state(worker, [None])  # a zombie reparented to init, reaped by it
    assert not rc_file.exists()

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert res["pid"] == sh.pid
    assert_running(sh.pid, "(restored sh)")
    assert_running(worker, "(restored workload)")
    written = io_wchar(worker)
    wait_until(lambda: io_wchar(worker) > written, 5, "the restored workload to make progress")
    wait_until(lambda: proc_state(worker) in (None, "Z"), 30, "the workload to finish")
    wait_until(lambda: rc_file.exists() and rc_file.read_text().endswith("\n"), 10,
               "sh to write the exit status")
    assert rc_file.read_text() == "0\n", "the restored workload must exit 0 at its end"


def test_stdout_on_a_terminal_continues_in_the_output_file(
    daemon: Daemon, procs: Procs
) -> None:
    cmd = workload("counter", "--steps", STEPS)
    ref = reference(with_interval(cmd, 0))
    master, pid = spawn_shell_job_on_pty(procs, with_interval(cmd, INTERVAL))
    try:
        reader = LineReader(master)
        reader.read_lines(4)
        fields = stat_fields(pid)
        assert fields is not None and int(fields[4]) == pid != int(fields[5]), (
            "the job must be in its own process group, not a session leader"
        )
        ck = assert_ok(daemon.ctl("dump", pid), "dump")
        out = stdio_of(ck, 1)
        assert out["kind"] == "tty" and "pseudo-terminal" in out["on_restore"], out
        pre = reader.read_to_eof()  # EIO: the dump killed the only slave holder
    finally:
        os.close(master)

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert res["pid"] == pid
    assert res["output_path"]
    post = wait_for_done(Path(res["output_path"]))
    assert_continuity(pre, post, ref)


def test_not_a_session_or_group_leader(daemon: Daemon, procs: Procs, tmp_path: Path) -> None:
    """``sh -c 'prog > FILE &'`` that exits at once: prog's session and group leader is gone."""
    cmd = workload("counter", "--steps", STEPS, "--interval-ms", INTERVAL)
    ref = reference(workload("counter", "--steps", STEPS, "--interval-ms", 0))
    out_path = tmp_path / "job.out"
    script = '"$@" > "$OUT" 2>/dev/null & echo $!'
    sh = procs.popen(
        ["sh", "-c", script, "sh", *cmd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OUT": str(out_path)}, text=True,
    )
    assert sh.stdout is not None
    pid = procs.add(int(sh.stdout.readline()))
    assert sh.wait(timeout=10) == 0
    wait_for_lines(out_path, 4)
    fields = stat_fields(pid)
    assert fields is not None
    pgrp, sid = int(fields[4]), int(fields[5])
    assert pgrp == sid == sh.pid != pid, "the job is neither session nor group leader"

    ck = assert_ok(daemon.ctl("dump", pid), "dump")
    wait_state(pid, [None, "Z"])
    pre = read_lines_file(out_path)
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert res["pid"] == pid
    lines = wait_for_done(out_path)
    assert_continuity(pre, lines[len(pre) :], ref)
    assert_same_lines(lines, ref, "the job's file")
