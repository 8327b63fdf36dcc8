"""Issue 33 (4): ghost files bounded per dump (``ghost_total_limit``) and per uid across the
dumps under way (``ghost_uid_limit``), not only per file: refused before anything is frozen,
in one line naming the setting; their bytes count in the staging choice (``begin``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.adapters.procfs.ghosts import ghost_files
from ckptd.core.ghosts import GhostBudget
from ckptd.daemon.config import DaemonConfig, load
from ckptd.domain import ProcessFact
from ckptd.errors import TargetRefused, TooManyRequests

from .world import JOB, JOB_TREE, USER, make_world

MiB = 1 << 20
SECOND_JOB = 5000
"""Another tree of USER's."""


def _one_line(exc: TargetRefused | TooManyRequests, *needles: str) -> None:
    text = exc.message + " " + (exc.hint or "")
    assert "\n" not in text, text
    for n in needles:
        assert n in text, (n, text)


def test_six_ghosts_each_within_ghost_limit_over_the_total_are_refused_before_freezing(
        tmp_path: Path) -> None:
    """The dump of the issue: six 250 MiB ghosts (1.5 GiB) under the default 1 GiB total."""
    world = make_world(tmp_path)
    for i in range(6):
        world.files.hold_ghost(JOB_TREE[i % 3], f"/dev/shm/torch_{i}", 250 * MiB)
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    _one_line(info.value, f"pid {JOB}", "6 deleted files", "1.5 GiB", "1.0 GiB",
              "ghost_total_limit", "/dev/shm/torch_0 (250.0 MiB)", "and 3 more",
              "daemon's configuration")
    assert world.criu.dump_jobs == [] and world.store.begun_ghost_bytes == {}
    assert world.states(*JOB_TREE) == ["running"] * 3
    assert world.dump_recipe.ghost_budget.taken(USER.uid) == 0


def test_within_the_total_the_dump_goes_on_and_stages_counting_the_ghosts(
        tmp_path: Path) -> None:
    world = make_world(tmp_path, ghost_total_limit=600 * MiB)
    world.files.hold_ghost(JOB, "/dev/shm/a", 250 * MiB)
    world.files.hold_ghost(1001, "/dev/shm/a", 250 * MiB)  # one file held by two: once
    world.files.hold_ghost(1002, "/dev/shm/b", 200 * MiB)
    world.files.hold_ghost(1002, "/dev/shm/huge", 300 * MiB)  # over ghost_limit: CRIU's
    record = world.dump(JOB, leave_running=True)
    assert world.store.begun_ghost_bytes[record.id] == 450 * MiB
    assert world.dump_recipe.ghost_budget.taken(USER.uid) == 0


def test_one_uids_dumps_under_way_together_are_bounded_by_ghost_uid_limit(
        tmp_path: Path) -> None:
    """While a dump of USER's job holds 800 MiB of ghosts (CRIU at work), a dump of USER's
    other job with 800 MiB is refused (1.5 GiB limit), that job left running; once the first
    has ended, the same dump goes through."""
    world = make_world(tmp_path, ghost_uid_limit=1536 * MiB)
    world.processes.add_tree(SECOND_JOB, 5001, uid=USER.uid, comm="second")
    for pid in (SECOND_JOB, 5001):
        world.processes.standard_stdio(pid)
    for i in range(4):  # 4 x 200 MiB each: within ghost_limit and ghost_total_limit
        world.files.hold_ghost(JOB, f"/dev/shm/first_{i}", 200 * MiB)
        world.files.hold_ghost(SECOND_JOB, f"/dev/shm/second_{i}", 200 * MiB)
    refused: list[BaseException] = []

    def second_dump(pid: int) -> None:
        if pid == JOB:
            with pytest.raises(TooManyRequests) as info:
                world.dump(SECOND_JOB, leave_running=True)
            refused.append(info.value)
    world.hooks.on["post_dump"] = second_dump
    world.dump(JOB, leave_running=True)
    assert len(refused) == 1
    assert isinstance(refused[0], TooManyRequests)
    _one_line(refused[0], f"pid {SECOND_JOB}", "800.0 MiB", "1.5 GiB", "uid 1000",
              "ghost_uid_limit")
    assert world.states(SECOND_JOB, 5001) == ["running"] * 2
    assert world.dump_recipe.ghost_budget.taken(USER.uid) == 0
    del world.hooks.on["post_dump"]
    world.dump(SECOND_JOB, leave_running=True)


def test_a_failed_dump_gives_its_ghost_bytes_back(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.files.hold_ghost(JOB, "/dev/shm/a", 100 * MiB)
    world.store.fail_commit = OSError("disk full")
    with pytest.raises(Exception):  # noqa: B017 (whatever the store's failure becomes)
        world.dump(JOB, leave_running=True)
    assert world.dump_recipe.ghost_budget.taken(USER.uid) == 0


def test_the_budget_is_per_uid_and_a_dump_alone_over_it_is_refused() -> None:
    budget = GhostBudget()
    budget.take("a", 1000, 3 * MiB, 4 * MiB, 10)
    budget.take("b", 2000, 4 * MiB, 4 * MiB, 11)  # another uid's: its own budget
    with pytest.raises(TooManyRequests):
        budget.take("c", 1000, 2 * MiB, 4 * MiB, 12)
    with pytest.raises(TooManyRequests):
        budget.take("d", 3000, 5 * MiB, 4 * MiB, 13)
    budget.take("a", 1000, 1 * MiB, 4 * MiB, 10)  # taken again (preview, inspect): replaced
    budget.take("c", 1000, 2 * MiB, 4 * MiB, 12)
    assert (budget.taken(1000), budget.taken(3000)) == (3 * MiB, 0)
    budget.give_back("a")
    budget.give_back("c")
    assert budget.taken(1000) == 0


def _load(tmp_path: Path, setting: str) -> DaemonConfig:
    config = tmp_path / "ckptd.toml"
    config.write_text(setting + "\n")
    return load(argparse.Namespace(config=str(config), store=None, state_dir=None))


def test_the_totals_are_settings(tmp_path: Path) -> None:
    assert (DaemonConfig.ghost_total_limit, DaemonConfig.ghost_uid_limit) == (1 << 30, 4 << 30)
    assert _load(tmp_path, "ghost_total_limit = 0").ghost_total_limit == 0
    assert _load(tmp_path, "ghost_uid_limit = 8589934592").ghost_uid_limit == 8 << 30
    for key in ("ghost_total_limit", "ghost_uid_limit"):
        for bad in ("-1", "1.5", "true", '"1G"'):
            with pytest.raises(ValueError, match=rf"^{key} .* must be a whole number of bytes"):
                _load(tmp_path, f"{key} = {bad}")


HOLDER = r"""
import mmap, os, sys
d = sys.argv[1]
fds = []
def ghost(name, size):
    fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"g" * size)
    os.unlink(os.path.join(d, name))
    return fd
fds.append(ghost("open-twice", 64 << 10))
fds.append(os.dup(fds[-1]))
m = mmap.mmap(ghost("mapped", 128 << 10), 128 << 10)  # held by a descriptor and a mapping
mapped = os.open(os.path.join(d, "linked"), os.O_RDWR | os.O_CREAT, 0o600)
os.write(mapped, b"l" * 4096)
os.link(os.path.join(d, "linked"), os.path.join(d, "other-name"))
os.unlink(os.path.join(d, "linked"))  # deleted, but linked elsewhere: no ghost
mfd = os.memfd_create("not-a-ghost")
os.write(mfd, b"m" * 8192)
shared = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)  # /dev/zero (deleted): not a file
shared[:1] = b"x"
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_proc_adapter_finds_each_ghost_once_with_its_allocated_size(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        fact = ProcessFact(proc.pid, os.getpid(), "python", (), os.getuid(), os.getgid())
        found = [g for g in ghost_files(Path("/proc"), [fact, fact])  # not pytest's own
                 if g.path.startswith(f"{tmp_path}/")]
        assert [(g.path, g.pid) for g in found] == [
            (str(tmp_path / "mapped"), proc.pid), (str(tmp_path / "open-twice"), proc.pid)]
        sizes = {Path(g.path).name: g.size for g in found}
        assert sizes["open-twice"] >= 64 << 10 and sizes["mapped"] >= 128 << 10
    finally:
        proc.kill()
        proc.wait()
