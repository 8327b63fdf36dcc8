"""Callers are who the kernel says (SO_PEERCRED): an unprivileged uid acts on its own
processes and checkpoints only; its restored processes keep its uid."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import (
    NOBODY,
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_one_line_error,
    assert_running,
    reference,
    uid_line,
    wait_for_done,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

EXIT_USAGE = 2


@pytest.fixture
def open_daemon(start_daemon: Any) -> Iterator[Daemon]:
    """A daemon whose socket any uid may connect to (mode 0666, in a world-searchable
    directory: pytest's temp directories are root-only)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-it-sock-", dir="/tmp"))
    try:
        sock_dir.chmod(0o755)
        yield start_daemon(config={"socket_mode": "666"}, socket_dir=sock_dir / "run")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


CAP_SYS_RESOURCE = 24


def has_cap_sys_resource() -> bool:
    """CRIU reads a dumped process's rlimits with prlimit(2), which needs CAP_SYS_RESOURCE
    unless CRIU's uid is the process's: without it no uid but 0 can be dumped."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def test_an_unprivileged_caller_cannot_touch_roots_process_or_checkpoints(
    open_daemon: Daemon, procs: Procs
) -> None:
    d = open_daemon
    assert d.socket.stat().st_mode & 0o777 == 0o666
    root_job = procs.popen(
        workload("counter", "--steps", 0, "--interval-ms", 50),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    res = d.ctl("dump", root_job.pid, user=NOBODY)
    assert_one_line_error(
        res, EXIT_USAGE, f"pid {root_job.pid} belongs to uid 0", f"the caller is uid {NOBODY}"
    )
    assert_running(root_job.pid, "(root's job, after a refused dump)")
    assert d.checkpoints_of(root_job.pid) == []

    root_ck = assert_ok(d.ctl("dump", root_job.pid, "--leave-running"), "dump as root")
    assert assert_ok(d.ctl("list", user=NOBODY), "list as nobody") == []
    for command in ("show", "delete", "restore"):
        res = d.ctl(command, root_ck["id"], user=NOBODY)
        assert_one_line_error(
            res, EXIT_USAGE, f"checkpoint {root_ck['id']} belongs to uid 0",
            f"the caller is uid {NOBODY}",
        )
    assert [c["id"] for c in assert_ok(d.ctl("list"), "list")] == [root_ck["id"]]
    assert_running(root_job.pid, "(root's job)")


def test_an_unprivileged_caller_dumps_and_restores_its_own_process(
    open_daemon: Daemon, procs: Procs
) -> None:
    d = open_daemon
    root_job = procs.popen(
        workload("counter", "--steps", 0, "--interval-ms", 50),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    root_ck = assert_ok(d.ctl("dump", root_job.pid, "--leave-running"), "dump as root")

    cmd = workload("counter", "--steps", 40)
    ref = reference(with_interval(cmd, 0))
    job = procs.popen(
        with_interval(cmd, 30), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
    )
    assert job.stdout is not None
    assert uid_line(job.pid) == [NOBODY] * 4
    reader = LineReader(job.stdout.fileno())
    reader.read_lines(4)

    if not has_cap_sys_resource():
        # CRIU cannot read the rlimits of another uid's process: the dump must fail cleanly
        res = d.ctl("dump", job.pid, user=NOBODY)
        assert_one_line_error(res, 1, f"pid {job.pid}", "rlimit", "not permitted",
                              "CAP_SYS_RESOURCE")
        assert_running(job.pid, "after a failed dump")
        assert d.checkpoints_of(job.pid) == []
        before = len(reader.drain())
        reader.read_lines(before + 2, timeout=5)
        pytest.skip(
            "this machine's root lacks CAP_SYS_RESOURCE, so CRIU cannot read the rlimits "
            "(prlimit) of a process of another uid: dumping a uid-65534 process fails (checked "
            "that it fails cleanly); restore as uid 65534 not tested"
        )

    ck = assert_ok(d.ctl("dump", job.pid, user=NOBODY), "dump as nobody")
    assert ck["uid"] == NOBODY
    pre = reader.read_to_eof()
    job.wait(timeout=10)

    listed = assert_ok(d.ctl("list", user=NOBODY), "list as nobody")
    assert [c["id"] for c in listed] == [ck["id"]], "uid 65534 sees its own checkpoint only"
    everything = assert_ok(d.ctl("list"), "list as root")
    assert {c["id"] for c in everything} == {ck["id"], root_ck["id"]}

    res = assert_ok(d.ctl("restore", ck["id"], user=NOBODY), "restore as nobody")
    procs.add(res["pid"])
    assert res["pid"] == job.pid
    assert_running(res["pid"], "(restored)")
    assert uid_line(res["pid"]) == [NOBODY] * 4, "the restored process must keep uid 65534"
    post = wait_for_done(Path(res["output_path"]))
    assert_continuity(pre, post, ref)


def test_a_name_is_its_owners(open_daemon: Daemon, procs: Procs) -> None:
    """Issue 21 (9): root's job and checkpoint named ``train`` neither block uid 65534's job
    of that name nor answer its ``restore --name train``, whose error never shows root's
    checkpoint id."""
    d = open_daemon
    root_job = procs.popen(
        workload("counter", "--steps", 0, "--interval-ms", 50),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    users_job = procs.popen(
        workload("counter", "--steps", 0, "--interval-ms", 50),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
    )
    root_ck = assert_ok(d.ctl("dump", root_job.pid, "--leave-running", "--name", "train"),
                        "dump as root")
    res = d.ctl("restore", "--name", "train", user=NOBODY)
    line = assert_one_line_error(res, EXIT_USAGE, "no checkpoint of name 'train'")
    assert root_ck["id"] not in line and "uid 0" not in line, line
    assert_ok(d.ctl("policy", "set", str(root_job.pid), "--name", "train", "--on-term"),
              "root's policy of train")
    assert_ok(d.ctl("policy", "set", str(users_job.pid), "--name", "train", "--on-term",
                    user=NOBODY), "uid 65534's policy of train beside root's")
    mine = assert_ok(d.ctl("policy", "show", user=NOBODY), "policy show as nobody")
    assert [(p["name"], p["pid"]) for p in mine] == [("train", users_job.pid)], mine
    assert_running(root_job.pid, "(root's job)")
    assert_running(users_job.pid, "(uid 65534's job)")
