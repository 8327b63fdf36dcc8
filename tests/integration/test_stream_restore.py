"""Streamed restores (``adapters.criu.imgstreamer``, ``stream_restore``): real CRIU reads every
image from ckptd through its image-streamer protocol, no image directory written first.

- CRIU restores a job from images streamed out of a plain directory, and it goes on exactly;
- a daemon restores a checkpoint streamed from its store (its log says so, nothing of the
  images is staged), and the job goes on exactly;
- a damaged frame of a pack, and a missing pack, make the streamed restore fail before the
  job runs: no restored process survives, the one-line error names the checkpoint and the
  object, the checkpoint stays listed.

Needs a CRIU with ckptd's patch (scripts/criu-patches/4.2.1: ``criu check --feature
rpc_stream``); skipped with that reason otherwise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.adapters.criu import CriuSwrk
from ckptd.core.ports import CriuHooks, CriuRestoreJob
from ckptd.core.store.restream import DirectoryImages

from .conftest import criu_path
from .flows import criu_swrk as _criu
from .flows import dump_and_restore_via_pipe, dump_into_directory, dump_killing
from .flows import image_dirs as _dirs
from .store_support import flip_byte, largest_pack
from .support import (
    Daemon,
    Procs,
    assert_continuity,
    assert_ok,
    assert_one_line_error,
    proc_state,
    reference,
    wait_for_done,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration


@functools.cache
def _no_stream_reason() -> str | None:
    path = criu_path()
    if path is None:
        return "no CRIU"
    if not CriuSwrk(path, plugin_dir=Path("/nonexistent")).feature("rpc_stream"):
        return (f"CRIU at {path} cannot stream a restore through RPC (no `criu check "
                "--feature rpc_stream`: build it with scripts/install-criu.sh, which applies "
                "scripts/criu-patches/4.2.1; CKPTD_TEST_CRIU=/path/to/criu to use another)")
    return None


@pytest.fixture(autouse=True)
def _needs_streaming_criu() -> None:
    reason = _no_stream_reason()
    if reason is not None:
        pytest.skip(reason)


def test_criu_restores_from_images_streamed_out_of_a_directory(
    tmp_path: Path, procs: Procs
) -> None:
    """The adapter alone: CRIU dumps into a directory, then restores from an empty one, every
    image asked for through the streamer; the job goes on exactly."""
    criu = _criu(tmp_path)
    cmd = workload("counter", "--steps", 80, "--mem-mib", 24)
    ref = reference(with_interval(cmd, 0))
    pid, dumped, out, pre = dump_into_directory(criu, procs, with_interval(cmd, 20), tmp_path)

    empty, work = _dirs(tmp_path / "restore")
    job = CriuRestoreJob(empty, work, images=DirectoryImages(dumped, "ck-test"))
    restored = criu.restore(job, CriuHooks())
    procs.add(restored)
    assert restored == pid
    log = (work / "restore.log").read_text()
    assert "Running pre-stream scripts" in log and "Dismissing the image streamer" in log
    assert not any(p.suffix == ".img" for p in empty.iterdir()), list(empty.iterdir())
    post = wait_for_done(out, timeout=60)[len(pre):]
    assert_continuity(pre, post, ref)


def _streaming_daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
    return start_daemon(config={"stream_restore": True, "gc_grace_s": 0})


def test_a_daemon_restores_a_checkpoint_streamed_from_its_store(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, workloads: Path
) -> None:
    """Through ckptctl: the restore streams (CRIU's log shows the streamer; nothing of the
    images is written) and the job goes on exactly."""
    del workloads
    daemon = _streaming_daemon(start_daemon)
    cmd = workload("counter", "--steps", 60, "--mem-mib", 32)
    ck, _ = dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd)
    logs = sorted((daemon.state_dir / "work").glob("*/restore.log"))
    assert logs, "no restore log"
    text = logs[-1].read_text()
    assert "Dismissing the image streamer" in text, text[-2000:]
    assert "streamed restore of " + ck["id"] in daemon.log()


@pytest.mark.parametrize("damage", ["frame-byte", "pack-missing"])
def test_a_damaged_or_missing_pack_fails_the_streamed_restore_before_the_job_runs(
    start_daemon: Callable[..., Daemon], procs: Procs, workloads: Path, damage: str
) -> None:
    """The pack holding the job's pages is damaged (one byte in a frame) or gone, after the
    daemon has indexed it (its caches warm: the damage is met only while CRIU reads). The
    restore fails with one line naming the checkpoint and the pack; no process of the job
    is left; the checkpoint is still listed."""
    del workloads
    daemon = _streaming_daemon(start_daemon)
    victim, _ = dump_killing(daemon, procs, workload("bigmem", "--mib", 32, "--steps", 0))
    pack = largest_pack(daemon.store)
    if damage == "frame-byte":
        flip_byte(pack, pack.stat().st_size // 2)
    else:
        pack.unlink()
    res = daemon.ctl("restore", victim["id"])
    line = assert_one_line_error(res, 1, victim["id"], pack.name)
    print(line)
    # CRIU had created the task (with the job's pid) when the pack failed and killed it
    # before it ran; the daemon answers once it is reaped, its empty output file removed
    for _ in range(3):
        assert proc_state(victim["pid"]) is None, (
            f"pid {victim['pid']} of the refused restore exists: {proc_state(victim['pid'])}")
        time.sleep(0.1)
    outputs = sorted((daemon.state_dir / "output").glob(f"{victim['id']}*"))
    assert not outputs, f"the refused restore left output files {outputs}"
    listed = assert_ok(daemon.ctl("list"), "list")
    assert victim["id"] in {c["id"] for c in listed}
