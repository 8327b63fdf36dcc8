"""Job flows and helpers several integration modules share (no test module imports another's
helpers): a dump and restore through a pipe, a killing dump of a piped job, a piped job dumped
with --leave-running, CRIU's swrk adapter with image directories (a job dumped into one), the
TCP pair job and CRIU's network-lock tables."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

from ckptd.adapters.criu.swrk import CriuSwrk
from ckptd.core.ports import CriuDumpJob, CriuHooks

from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continuity,
    assert_ok,
    assert_running,
    criu_path,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_state,
    wait_until,
    with_interval,
)

TCP_PAIR = Path(__file__).parent / "jobs" / "tcp_pair.py"

def dump_and_restore_via_pipe(
    daemon: Daemon,
    procs: Procs,
    tmp_path: Path,
    cmd: list[str],
    *,
    interval_ms: int = 30,
    k: int = 5,
    ref_cmd: list[str] | None = None,
    after_restore: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The continuity check with stdout on a pipe; returns (dump JSON, restore JSON)."""
    ref = reference(with_interval(ref_cmd or cmd, 0))
    with open(tmp_path / "stderr", "wb") as err:
        proc = procs.popen(
            with_interval(cmd, interval_ms), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    reader.read_lines(k)

    ck = assert_ok(daemon.ctl("dump", proc.pid), "dump")
    assert ck["pid"] == proc.pid
    assert ck["id"].startswith("ck-")
    assert [c["id"] for c in daemon.checkpoints_of(proc.pid)] == [ck["id"]]
    pre = reader.read_to_eof()
    assert proc.wait(timeout=10) == -signal.SIGKILL, "the dump did not kill the workload"

    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    assert res["id"] == ck["id"]
    assert res["pid"] == proc.pid, "CRIU restores the tree with its original pids"
    assert res["output_path"], "stdout was a pipe: the restore must report its output file"
    if after_restore is not None:
        after_restore(res["pid"])
    post = wait_for_done(Path(res["output_path"]), timeout=60)
    assert_continuity(pre, post, ref)
    return ck, res

def dump_killing(d: Daemon, procs: Procs, cmd: list[str], interval_ms: int = 20,
                 ) -> tuple[dict[str, Any], list[str]]:
    """Run ``cmd`` (stdout on a pipe), dump it after 3 lines (which kills it); returns the
    checkpoint and the lines printed before the dump."""
    proc = procs.popen(
        with_interval(cmd, interval_ms), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    reader.read_lines(3, timeout=30)
    ck = assert_ok(d.ctl("dump", proc.pid), "dump")
    pre = reader.read_to_eof()
    proc.wait(timeout=10)
    return ck, pre

class Job:
    """A workload with stdout on a pipe we read (restores get an output file instead)."""

    def __init__(self, procs: Procs, cmd: list[str], interval_ms: int = 50) -> None:
        self.proc = procs.popen(
            with_interval(cmd, interval_ms), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid

    def dump_leave_running(self, d: Daemon, *args: object) -> tuple[dict[str, Any], int, int]:
        """(checkpoint, lines printed before the dump, lines printed when it had returned)."""
        low = len(self.reader.drain())
        ck = assert_ok(d.ctl("dump", self.pid, "--leave-running", *args), "dump --leave-running")
        high = len(self.reader.drain())
        assert ck["leave_running"] is True
        assert_running(self.pid, "after a --leave-running dump")
        return ck, low, high

    def kill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(timeout=10) == -signal.SIGKILL
        wait_state(self.pid, [None])

def criu_swrk(tmp_path: Path) -> CriuSwrk:
    path = criu_path()
    assert path is not None
    return CriuSwrk(path, plugin_dir=tmp_path / "plugins")

def image_dirs(root: Path) -> tuple[Path, Path]:
    images, work = root / "images", root / "work"
    images.mkdir(parents=True)
    work.mkdir()
    return images, work

def dump_into_directory(criu: CriuSwrk, procs: Procs, cmd: list[str], root: Path
                        ) -> tuple[int, Path, Path, list[str]]:
    """``cmd`` started detached (its output in ``root/out``) and, once it printed 5 lines,
    dumped by the adapter alone into ``root/dump/images`` (a killing dump, CRIU's own image
    directory): (its pid, the images, the output file, the lines printed before the dump)."""
    out = root / "out"
    pid = start_detached(procs, cmd, out)
    wait_for_lines(out, 5)
    dumped, work = image_dirs(root / "dump")
    criu.dump(CriuDumpJob(pid, dumped, work, leave_running=False), CriuHooks()).finish()
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the dumped process to be gone")
    return pid, dumped, out, out.read_text().splitlines()


def criu_tables() -> list[str]:
    """CRIU's nftables tables (its network locks) on this node. A test compares them with
    those there before it: a checkpoint of a tree with connections that is never restored
    here leaves its table on the node by design (docs/limits.md), so an earlier run's may be
    there."""
    from pyroute2.netlink.nfnetlink.nftsocket import NFPROTO_INET
    from pyroute2.nftables.main import NFTables

    with NFTables(nfgen_family=NFPROTO_INET) as nft:
        names = [t.get_attr("NFTA_TABLE_NAME") for t in nft.get_tables()]
    return [n for n in names if n and n.startswith("CRIU")]
