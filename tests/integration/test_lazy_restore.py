"""Lazy restores (``adapters.criu.lazypages``, ``ckptctl restore --lazy``): real CRIU restores
the tree without its anonymous memory, CRIU's lazy-pages daemon asks ckptd for each page
(userfaultfd), and the job goes on exactly.

- the adapter alone: images in a directory, a job whose every step reads pages of its 48 MiB;
  its output equals an uninterrupted run's, and every page was served by ckptd;
- the daemon: ``ckptctl restore --lazy`` of a checkpoint in its store; the job goes on
  exactly, ``restore.lazy_done`` says every page came in;
- a damaged frame met by a lazy restore: the restored job is killed before it runs on a page
  it did not get (``restore.lazy_failed`` names the checkpoint and the object), and nothing
  of it prints a line the uninterrupted run would not have printed.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ckptd.adapters.criu import CriuSwrk
from ckptd.core.ports import CriuHooks, CriuRestoreJob
from ckptd.core.store.restream import DirectoryImages
from ckptd.errors import CkptdError

from .conftest import criu_path
from .flows import criu_swrk as _criu
from .flows import dump_into_directory
from .flows import image_dirs as _dirs
from .store_support import Daemons, flip_byte, largest_pack
from .support import (
    Daemon,
    Procs,
    assert_continuity,
    assert_ok,
    is_alive,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

MEM_MIB = 48


@functools.cache
def _no_lazy_reason() -> str | None:
    path = criu_path()
    if path is None:
        return "no CRIU"
    criu = CriuSwrk(path, plugin_dir=Path("/nonexistent"))
    if not criu.feature("rpc_stream"):
        return f"CRIU at {path} lacks ckptd's patch (scripts/criu-patches)"
    if not criu.feature("uffd-noncoop"):
        return "this kernel's userfaultfd cannot restore lazily (criu check uffd-noncoop)"
    return None


@pytest.fixture(autouse=True)
def _needs_lazy_criu() -> None:
    reason = _no_lazy_reason()
    if reason is not None:
        pytest.skip(reason)


class Told:
    """``ports.LazyPages`` as a test sees it: what the adapter told, and when."""

    def __init__(self) -> None:
        self.helper = 0
        self.pages = -1
        self.error: CkptdError | None = None
        self.ended = threading.Event()

    def started(self, helper_pid: int) -> None:
        self.helper = helper_pid

    def failed(self, error: CkptdError) -> None:
        self.error = error
        self.ended.set()

    def done(self, pages: int, seconds: float) -> None:
        del seconds
        self.pages = pages
        self.ended.set()


def _counter() -> tuple[list[str], list[str]]:
    cmd = workload("counter", "--steps", 60, "--mem-mib", MEM_MIB)
    return with_interval(cmd, 25), reference(with_interval(cmd, 0))


def test_criu_restores_lazily_with_every_page_served_by_ckptd(
    tmp_path: Path, procs: Procs
) -> None:
    criu = _criu(tmp_path)
    cmd, ref = _counter()
    pid, dumped, out, pre = dump_into_directory(criu, procs, cmd, tmp_path)

    staged, work = _dirs(tmp_path / "restore")
    told = Told()
    job = CriuRestoreJob(staged, work, images=DirectoryImages(dumped, "ck-lazy"), lazy=told)
    restored = criu.restore(job, CriuHooks())
    procs.add(restored)
    assert restored == pid and told.helper > 0
    post = wait_for_done(out, timeout=60)[len(pre):]
    assert_continuity(pre, post, ref)
    assert told.ended.wait(30), "the lazy restore never ended"
    assert told.error is None, told.error
    assert told.pages >= MEM_MIB * 256, f"only {told.pages} pages served: not lazy"
    assert "nr_lazy" in (work / "restore.log").read_text()
    sparse = [p for p in staged.iterdir() if p.name.startswith("pages-")]
    assert sparse and all(p.stat().st_blocks * 512 < MEM_MIB << 20 for p in sparse), \
        "the staged pages images hold the lazy pages"


REACTION_S = 0.5
"""How long ``KillsTheTree`` takes to kill: 20 steps of the job, were it running."""


class KillsTheTree(Told):
    """``LazyPages`` as LazyWatch is: ``failed`` SIGKILLs the restored tree (once the test
    knows its pid, and REACTION_S later) and returns when it is dead."""

    def __init__(self) -> None:
        super().__init__()
        self.root = 0
        self.restored = threading.Event()
        self.before_kill = ("", "")
        """The tree's root's state and wait channel when ``failed`` came to kill it."""

    def failed(self, error: CkptdError) -> None:
        assert self.restored.wait(30)
        time.sleep(REACTION_S)  # the guarantee must not depend on how fast this comes
        stat = Path(f"/proc/{self.root}/stat").read_text()
        self.before_kill = (stat.rsplit(")", 1)[1].split()[0],
                            Path(f"/proc/{self.root}/wchan").read_text())
        os.kill(self.root, signal.SIGKILL)
        wait_until(lambda: not is_alive(self.root), 10, "the restored tree to die")
        super().failed(error)


def test_a_page_daemon_that_dies_leaves_the_job_waiting_never_running_on_zeros(
    tmp_path: Path, procs: Procs
) -> None:
    """CRIU's lazy-pages daemon SIGKILLed as soon as the restore returns, most of the job's
    256 MiB not yet served: its userfaultfds are not released (ckptd holds copies), so the
    job waits on its next missing page (in ``handle_userfault``) instead of going on without
    it, until ckptd, told (``failed``), kills it — here REACTION_S later. (Without the copies
    this kernel ends the job by itself, SIGBUS at its next fault: a zombie by then.)"""
    criu = _criu(tmp_path)
    cmd = workload("counter", "--steps", 60, "--mem-mib", 256)
    ref = reference(with_interval(cmd, 0))
    _pid, dumped, out, pre = dump_into_directory(criu, procs, with_interval(cmd, 25), tmp_path)

    staged, work = _dirs(tmp_path / "restore")
    told = KillsTheTree()
    job = CriuRestoreJob(staged, work, images=DirectoryImages(dumped, "ck-lazy"), lazy=told)
    told.root = criu.restore(job, CriuHooks())
    os.kill(told.helper, signal.SIGKILL)
    procs.add(told.root)
    told.restored.set()
    assert told.ended.wait(30), "ckptd was never told the page daemon ended"
    assert told.error is not None and "hung up" in str(told.error), told.error
    assert told.pages < 0, "every page was in before the page daemon was killed: no test"
    assert told.before_kill == ("S", "handle_userfault"), \
        f"the job was not waiting for its page when killed: {told.before_kill}"
    assert not is_alive(told.root)
    lines = out.read_text().splitlines()
    assert lines == ref[:len(lines)], "the job ran on pages it never got"
    assert lines[:len(pre)] == pre and len(lines) < len(ref)


def _events(daemon: Daemon, kind: str) -> list[dict[str, object]]:
    res = daemon.ctl("events", "--last", "200")
    assert res.rc == 0, res.err
    text = res.out if isinstance(res.out, str) else json.dumps(res.out)
    found = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [e for e in found if e["kind"] == kind]


@pytest.fixture
def streaming(start_daemon: object) -> Daemon:
    assert callable(start_daemon)
    daemon = start_daemon(config={"stream_restore": True, "gc_grace_s": 0})
    assert isinstance(daemon, Daemon)
    return daemon


def test_ckptctl_restore_lazy_brings_the_job_back_exactly(
    streaming: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd, ref = _counter()
    out = tmp_path / "out"
    pid = start_detached(procs, cmd, out)
    wait_for_lines(out, 5)
    ck = assert_ok(streaming.ctl("dump", pid), "dump")["id"]
    pre = out.read_text().splitlines()
    res = assert_ok(streaming.ctl("restore", ck, "--lazy", "--output", out), "restore --lazy")
    procs.add(res["pid"])
    assert res["lazy"] is True, res
    post = wait_for_done(out, timeout=60)[len(pre):]
    assert_continuity(pre, post, ref)
    wait_until(lambda: _events(streaming, "restore.lazy_done"), 30, "restore.lazy_done")
    done = _events(streaming, "restore.lazy_done")[-1]
    assert done["checkpoint_id"] == ck and done["pid"] == pid, done


def test_children_forked_before_the_pages_are_in_read_them_exactly(
    streaming: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """A job that forks after a lazy restore: each step's child reads every page of the
    buffer, which its parent has mostly not touched yet, so those pages reach the child
    through CRIU's fork events (its own userfaultfd). Its hashes feed the output."""
    cmd = workload("counter", "--steps", 40, "--mem-mib", 96, "--fork-readers")
    ref = reference(with_interval(cmd, 0))
    out = tmp_path / "out"
    pid = start_detached(procs, with_interval(cmd, 10), out)
    wait_for_lines(out, 5)
    ck = assert_ok(streaming.ctl("dump", pid), "dump")["id"]
    pre = out.read_text().splitlines()
    res = assert_ok(streaming.ctl("restore", ck, "--lazy", "--output", out), "restore --lazy")
    procs.add(res["pid"])
    post = wait_for_done(out, timeout=60)[len(pre):]
    assert_continuity(pre, post, ref)
    wait_until(lambda: _events(streaming, "restore.lazy_done"), 30, "restore.lazy_done")
    done = _events(streaming, "restore.lazy_done")[-1]
    assert done["checkpoint_id"] == ck, done
    # The first step after the restore forks within one interval (10 ms) of the tree
    # running: the pages were still coming in, so a child read them through the fork.
    fields = done["fields"]
    assert isinstance(fields, dict), done
    assert float(fields["seconds"]) > 0.05, f"all pages were in before any fork: {done}"


def test_a_process_whose_pages_are_in_runs_on_while_another_s_still_come(
    streaming: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """Two processes restored lazily: a small one gets its pages first, then drops and
    refills a page each step (madvise: a userfaultfd REMOVE event, then a fault on the
    page), while the big one's 512 MiB still come in. CRIU closes the small one's
    userfaultfd once its pages are in; nothing may keep the small one waiting then. (ckptd
    held its copy of that userfaultfd until every page of the tree was in: the small one
    waited forever in ``userfaultfd_event_wait_completion``, and so did a lazily restored
    torchrun DDP job, ~1 run in 10.)"""
    small = workload("counter", "--steps", 80, "--mem-mib", 8, "--drop-page")
    big = workload("counter", "--steps", 80, "--mem-mib", 512)
    refs = [reference(with_interval(small, 0)), reference(with_interval(big, 0))]
    outs = [tmp_path / "small.out", tmp_path / "big.out"]
    script = (f"{' '.join(with_interval(small, 30))} > {outs[0]} & "
              f"{' '.join(with_interval(big, 30))} > {outs[1]} & wait")
    pid = start_detached(procs, ["/bin/sh", "-c", script], tmp_path / "sh.out")
    for out in outs:
        wait_for_lines(out, 5)
    ck = assert_ok(streaming.ctl("dump", pid), "dump")["id"]
    pres = [out.read_text().splitlines() for out in outs]
    res = assert_ok(streaming.ctl("restore", ck, "--lazy", "--output", tmp_path / "sh.out"),
                    "restore --lazy")
    procs.add(res["pid"])
    for out, pre, ref in zip(outs, pres, refs, strict=True):
        post = wait_for_done(out, timeout=30)[len(pre):]
        assert_continuity(pre, post, ref)
    wait_until(lambda: _events(streaming, "restore.lazy_done"), 30, "restore.lazy_done")


def test_a_job_killed_before_its_pages_are_in_ends_the_restore_saying_so(
    streaming: Daemon, procs: Procs, tmp_path: Path
) -> None:
    """The user kills the job right after a lazy restore of its 256 MiB: CRIU's page daemon
    ends with its last task, and ckptd says the tree ended, not that every page came in."""
    cmd = workload("counter", "--steps", 1000, "--mem-mib", 256)
    out = tmp_path / "out"
    pid = start_detached(procs, with_interval(cmd, 100), out)
    wait_for_lines(out, 3)
    ck = assert_ok(streaming.ctl("dump", pid), "dump")["id"]
    res = assert_ok(streaming.ctl("restore", ck, "--lazy", "--output", out), "restore --lazy")
    procs.add(res["pid"])
    os.kill(res["pid"], signal.SIGKILL)
    wait_until(lambda: _events(streaming, "restore.lazy_done"), 30, "restore.lazy_done")
    done = _events(streaming, "restore.lazy_done")[-1]
    fields = done["fields"]
    assert isinstance(fields, dict) and fields["tree_ended"] is True, done
    assert "ended with its tree" in str(done["message"]), done
    assert float(fields["pages"]) < 256 * 256, f"every page came in, killed too late: {done}"
    assert not _events(streaming, "restore.lazy_failed")


def test_a_damaged_page_kills_the_lazily_restored_job_before_it_runs_on(
    streaming: Daemon, procs: Procs, tmp_path: Path
) -> None:
    cmd, ref = _counter()
    out = tmp_path / "out"
    pid = start_detached(procs, cmd, out)
    wait_for_lines(out, 5)
    ck = assert_ok(streaming.ctl("dump", pid), "dump")["id"]
    pre = out.read_text().splitlines()
    pack = largest_pack(streaming.store)
    flip_byte(pack, pack.stat().st_size // 2)  # a frame of the job's heap: served lazily
    res = streaming.ctl("restore", ck, "--lazy", "--output", out)
    assert res.rc == 0, f"the damage was met before the job ran: {res.err}"
    procs.add(res.out["pid"])
    wait_until(lambda: _events(streaming, "restore.lazy_failed"), 30, "restore.lazy_failed")
    failed = _events(streaming, "restore.lazy_failed")[-1]
    assert failed["checkpoint_id"] == ck and failed["pid"] == pid, failed
    assert f"checkpoint {ck}" in str(failed["message"]), failed
    assert "pack" in str(failed["message"]), failed
    wait_until(lambda: not is_alive(pid), 10, "the restored job to be killed")
    assert not _events(streaming, "restore.lazy_done")
    lines = out.read_text().splitlines()
    assert lines[:len(pre)] == pre
    assert lines == ref[:len(lines)], "the restored job printed what it would never have"
    assert len(lines) < len(ref), "the job finished on damaged memory"


def _lazy_helpers(daemon_pid: int) -> list[int]:
    """Pids of the ``criu lazy-pages`` processes a daemon started (its children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == daemon_pid and b"lazy-pages" in argv:
            found.append(int(proc.name))
    return found


def test_a_daemon_killed_mid_lazy_restore_leaves_the_job_waiting_and_its_restart_kills_it(
    tmp_path: Path, procs: Procs, workloads: Path
) -> None:
    """ckptd SIGKILLed while it serves a lazy restore's pages: the job waits on its next
    missing page (the lazy-pages daemon keeps ckptd's end of the socket: it sees no end of
    file and releases nothing), never running on a page it did not get; the next start of
    ckptd kills the job, then the lazy-pages daemon, from the restore's journal entry."""
    del workloads
    ds = Daemons(tmp_path / "ds")
    try:
        d = ds.start()
        cmd = workload("counter", "--steps", 60, "--mem-mib", 256)
        ref = reference(with_interval(cmd, 0))
        out = tmp_path / "out"
        pid = start_detached(procs, with_interval(cmd, 25), out)
        wait_for_lines(out, 5)
        ck = assert_ok(d.ctl("dump", pid), "dump")["id"]
        res = assert_ok(d.ctl("restore", ck, "--lazy", "--output", out), "restore --lazy")
        helpers = _lazy_helpers(d.proc.pid)
        ds.kill9(d)
        procs.add(res["pid"])
        assert len(helpers) == 1, helpers
        time.sleep(REACTION_S)
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0], Path(f"/proc/{pid}/wchan").read_text()
        assert state == ("S", "handle_userfault"), f"not waiting for its page: {state}"
        assert is_alive(helpers[0])

        again = ds.start()
        wait_until(lambda: not is_alive(pid) and not is_alive(helpers[0]), 30,
                   "the restart to kill the job and the lazy-pages daemon")
        assert "recovered" in again.log(), again.log()[-3000:]
        lines = out.read_text().splitlines()
        assert lines == ref[:len(lines)] and len(lines) < len(ref)
        ds.stop(again)
    finally:
        ds.close()
