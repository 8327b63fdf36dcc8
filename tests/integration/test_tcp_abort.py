"""A dump of a tree with established TCP connections that is abandoned after CRIU wrote its
images (the commit failed, the group aborted): CRIU, still holding the tree, resumes it with
its connections out of repair mode and the network unlocked — the job talks on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.adapters.criu import CriuSwrk
from ckptd.core.ports import CriuDumpJob, CriuHooks

from .conftest import criu_path
from .flows import TCP_PAIR as PAIR
from .flows import criu_tables as _criu_tables
from .support import Procs, proc_state, wait_until

pytestmark = pytest.mark.integration


def test_an_abandoned_tcp_dump_resumes_the_tree_and_unlocks_the_network(
    tmp_path: Path, procs: Procs
) -> None:
    path = criu_path()
    assert path is not None
    criu = CriuSwrk(path, plugin_dir=tmp_path / "plugins")
    tables_before = set(_criu_tables())
    out = tmp_path / "out.txt"
    with open(out, "wb") as stdout:
        job = procs.popen([sys.executable, str(PAIR), "200", "50"], stdin=subprocess.DEVNULL,
                          stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: len(out.read_text().splitlines()) >= 3, 30, "3 steps")
    images, work = tmp_path / "img", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    held = criu.dump(CriuDumpJob(job.pid, images, work, leave_running=False,
                                 leave_stopped=True, tcp_established=True), CriuHooks())
    assert held.holds_connections
    assert set(_criu_tables()) - tables_before  # locked while CRIU holds the tree
    frozen_at = len(out.read_text().splitlines())
    held.abort()
    assert set(_criu_tables()) - tables_before == set()
    assert proc_state(job.pid) not in ("T", "t", None)
    wait_until(lambda: len(out.read_text().splitlines()) >= frozen_at + 5, 30,
               "the job to talk on over its connection")
