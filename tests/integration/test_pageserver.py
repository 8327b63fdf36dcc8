"""CRIU's page-server protocol received by ckptd (``adapters.criu.pageserver``), against real
CRIU dumping a real process: the pagemap and pages images rebuilt from what CRIU sent are
byte for byte those CRIU writes itself, CRIU restores from them, and the pages can go
straight into the store as they arrive."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptd.adapters.criu import CriuSwrk
from ckptd.adapters.criu.pageserver import FileSink, PageServer, PageSink, wire_for
from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.core.ports import CriuDumpJob, CriuHooks, CriuRestoreJob
from ckptd.core.store import pagelist
from ckptd.core.store.index import PageIndex
from ckptd.core.store.pagehash import ZERO_REF, PageHasher
from ckptd.core.store.reader import PageSource
from ckptd.core.store.streaming import SPILL_NAME, StreamedPages
from ckptd.errors import CriuFailed
from ckptd.testing import MemoryBlobStore

from .flows import criu_swrk as _criu
from .flows import dump_and_restore_via_pipe
from .flows import image_dirs as _dirs
from .support import (
    Daemon,
    Procs,
    assert_continuity,
    reference,
    start_detached,
    wait_for_done,
    wait_for_lines,
    wait_state,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration


def _dump_to_server(
    criu: CriuSwrk, pid: int, root: Path, *, leave_running: bool,
    sink: PageSink | None = None,
) -> tuple[Path, PageServer]:
    images, work = _dirs(root)
    server = PageServer(images, sink if sink is not None else FileSink(images),
                        chunk=1 << 20, buffers=4, wire=wire_for(criu.status().version))
    server.start()
    job = CriuDumpJob(pid, images, work, leave_running=leave_running,
                      page_server_fd=server.criu_end().fileno())
    dump = criu.dump(job, CriuHooks())
    server.close_criu_end()
    server.wait(30)
    dump.finish()
    return images, server


def _stopped(procs: Procs, cmd: list[str], out: Path) -> int:
    """The job started, a few steps on, then stopped, so that two dumps see the same memory.
    On one CPU: the kernel writes the CPU a task runs on into its rseq area (its memory), and
    CRIU's parasite runs in the task; on two CPUs two dumps could differ there."""
    pid = start_detached(procs, with_interval(cmd, 20), out)
    os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
    wait_for_lines(out, 5)
    os.kill(pid, signal.SIGSTOP)
    wait_state(pid, ("T",))
    return pid


def _counter(mem_mib: int) -> list[str]:
    return workload("counter", "--steps", 120, "--mem-mib", mem_mib)


def test_pages_received_are_criu_s_own_images_and_restore(tmp_path: Path, procs: Procs) -> None:
    """The same stopped process dumped twice: once CRIU writing its images, once sending its
    pages to the receiver. Every image is the same, byte for byte (pagemaps and pages
    included); CRIU restores from the received ones and the job goes on exactly."""
    criu = _criu(tmp_path)
    cmd = _counter(48)
    ref = reference(with_interval(cmd, 0))
    out = tmp_path / "out"
    pid = _stopped(procs, cmd, out)

    local, work = _dirs(tmp_path / "local")
    criu.dump(CriuDumpJob(pid, local, work, leave_running=True), CriuHooks()).finish()
    wait_state(pid, ("T",))  # CRIU leaves a stopped task stopped
    received, server = _dump_to_server(criu, pid, tmp_path / "ps", leave_running=False)

    names = {p.name for p in local.iterdir() if p.suffix == ".img"}
    page_names = {n for n in names if n.startswith(("pagemap-", "pages-"))}
    assert page_names and set(server.stats.images) == page_names
    assert {p.name for p in received.iterdir() if p.suffix == ".img"} == names
    for name in sorted(page_names):
        assert (received / name).read_bytes() == (local / name).read_bytes(), name
    assert server.stats.pages * 4096 == sum(
        (local / n).stat().st_size for n in page_names if n.startswith("pages-"))
    assert server.stats.pages >= 48 * 256

    # the dump killed it; init reaps it (slowly, on these machines) before its pid is free
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the dumped process to be gone")
    pre = out.read_text().splitlines()
    restored = criu.restore(CriuRestoreJob(received, tmp_path / "ps" / "work"), CriuHooks())
    procs.add(restored)
    assert restored == pid
    os.kill(restored, signal.SIGCONT)  # it was dumped stopped
    post = wait_for_done(out, timeout=60)[len(pre):]
    assert_continuity(pre, post, ref)


def test_pages_go_into_the_store_as_criu_sends_them(tmp_path: Path, procs: Procs) -> None:
    """The receiver feeding ``StreamedPages``: CRIU's pages end up in packs (nothing but the
    small images staged), and every page read back from the store is the page CRIU wrote."""
    criu = _criu(tmp_path)
    out = tmp_path / "out"
    pid = _stopped(procs, _counter(32), out)
    local, work = _dirs(tmp_path / "local")
    criu.dump(CriuDumpJob(pid, local, work, leave_running=True), CriuHooks()).finish()

    blobs = LocalBlobStore(tmp_path / "store")
    hasher = PageHasher(b"test-secret", os.getuid())
    index = PageIndex()
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=hasher, executor=pool,
                             writer=writer, pack_bytes=4 << 20)
        staged, _server = _dump_to_server(criu, pid, tmp_path / "ps", leave_running=True,
                                          sink=sink)
        sink.finish()
        assert not any(p.name.startswith("pages-") for p in staged.iterdir())
        assert sink.new_packs and sink.written_packs
        for name, packed in sink.refs.items():
            refs = pagelist.Refs(packed)  # 16 bytes a page, issue #13
            want = (local / name).read_bytes()
            assert sink.sizes[name] == len(want) == len(refs) * 4096
            assert sum(r != ZERO_REF for r in refs) > 0 or not want.strip(b"\0")
            rebuilt = tmp_path / f"rebuilt-{name}"
            PageSource(blobs, index, hasher, pool, name).write_pages(refs, rebuilt, frozenset())
            assert rebuilt.read_bytes() == want, name
    os.kill(pid, signal.SIGKILL)


def test_a_stalled_ingest_never_holds_criu_the_pages_spill(tmp_path: Path, procs: Procs) -> None:
    """Issue 25: a receiver pool of one 1 MiB chunk and a store whose pack writes are held.
    CRIU's dump still ends (the tree let go) before a single pack is written: what ingest
    could not take went to the spill file; once writes go on, ``finish`` stores every page
    exactly as CRIU wrote it, and the spill is gone."""
    criu = _criu(tmp_path)
    out = tmp_path / "out"
    pid = _stopped(procs, _counter(32), out)
    local, work = _dirs(tmp_path / "local")
    criu.dump(CriuDumpJob(pid, local, work, leave_running=True), CriuHooks()).finish()

    blobs = MemoryBlobStore()
    released = threading.Event()
    blobs.on_put = lambda key: None if not key.startswith("packs/") else released.wait(60)
    hasher = PageHasher(b"test-secret", os.getuid())
    index = PageIndex()
    spill_dir = tmp_path / "staging" / "ck"
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(1) as writer:
        sink = StreamedPages(blobs=blobs, index=index, hasher=hasher, executor=pool,
                             writer=writer, pack_bytes=4 << 20, spill_dir=spill_dir)
        timer = threading.Timer(45, released.set)  # without a spill CRIU waits until then
        timer.start()
        try:
            images, work2 = _dirs(tmp_path / "ps")
            server = PageServer(images, sink, chunk=1 << 20, buffers=1,
                                wire=wire_for(criu.status().version))
            server.start()
            job = CriuDumpJob(pid, images, work2, leave_running=True,
                              page_server_fd=server.criu_end().fileno())
            dump = criu.dump(job, CriuHooks())
            server.close_criu_end()
            server.wait(30)
            dump.finish()  # CRIU has let the tree go
            assert not released.is_set(), "CRIU waited for the store"
            assert not any(k.startswith("packs/") for k in blobs.puts)
            assert (spill_dir / SPILL_NAME).stat().st_size >= 16 << 20
            assert server.stats.peak_buffers == 1
        finally:
            released.set()
            timer.cancel()
        sink.finish()
        assert not spill_dir.exists()
        for name, packed in sink.refs.items():
            want = (local / name).read_bytes()
            assert sink.sizes[name] == len(want)
            rebuilt = tmp_path / f"rebuilt-{name}"
            PageSource(blobs, index, hasher, pool, name).write_pages(
                pagelist.Refs(packed), rebuilt, frozenset())
            assert rebuilt.read_bytes() == want, name
    os.kill(pid, signal.SIGKILL)


def test_a_daemon_streaming_pages_dumps_and_restores_a_job(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, workloads: Path
) -> None:
    """``stream_pages = true``: CRIU sends the pages to the daemon (its log says it used the
    socket it was given), nothing but the other images is staged, and the job restored from
    the checkpoint goes on exactly."""
    del workloads
    daemon = start_daemon(config={"stream_pages": True})
    cmd = workload("counter", "--steps", 60, "--mem-mib", 64)
    ck, _ = dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd)
    assert ck["bytes"] > 64 * 2**20, "a 64 MiB heap of random pages must be in the store"
    log = (daemon.state_dir / "work" / ck["id"] / "dump.log").read_text()
    assert "Reusing ps socket" in log
    assert "Disconnect from the page server" in log


class _BrokenSink(FileSink):
    def pages(self, name: str, offset: int, data: memoryview) -> None:
        raise OSError("no space left in the store")


def test_a_sink_failing_mid_dump_fails_the_dump_and_the_job_runs_on(
    tmp_path: Path, procs: Procs
) -> None:
    criu = _criu(tmp_path)
    out = tmp_path / "out"
    pid = start_detached(procs, with_interval(_counter(16), 20), out)
    wait_for_lines(out, 3)
    images, work = _dirs(tmp_path / "ps")
    job = CriuDumpJob(pid, images, work, leave_running=False, leave_stopped=True,
                      page_sink=_BrokenSink(images))
    with pytest.raises(CriuFailed):
        criu.dump(job, CriuHooks())
    n = len(out.read_text().splitlines())
    wait_for_lines(out, n + 3, timeout=10)  # CRIU resumed it: it goes on
