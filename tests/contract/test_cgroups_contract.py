"""The ``Cgroups`` contract: ``CgroupFs`` (real processes moved between cgroups the test makes
under the node's cgroup v2 hierarchy, removed afterwards) and ``FakeCgroups`` alike."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.procfs.cgroups import (
    CgroupFs,
    cgroup2_mounts,
    cgroup2_root_with,
    cgroup_v2_path,
)
from ckptd.core.ports import Cgroups
from ckptd.errors import CgroupUnavailable, ProcessNotFound
from ckptd.testing import FakeCgroups, FakeProcessTable


class CgroupsHarness:
    cgroups: Cgroups
    base: str
    """A cgroup of the test's own, empty, under which it may make others."""
    here: str
    """The cgroup a new process starts in."""

    def process(self) -> int:
        """A new running process (in ``here``)."""
        raise NotImplementedError

    def end(self, pid: int) -> None:
        """End the process and reap it."""
        raise NotImplementedError

    def make(self, cgroup: str) -> None:
        raise NotImplementedError

    def make_refusing(self, cgroup: str) -> None:
        """A cgroup that takes no processes."""
        raise NotImplementedError

    def exists(self, cgroup: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RealCgroups(CgroupsHarness):
    def __init__(self, fs: CgroupFs) -> None:
        self.fs = fs
        self.cgroups = fs
        self.base = f"/ckptd-contract-{os.getpid()}-{secrets.token_hex(3)}"
        (fs.mount / self.base[1:]).mkdir()
        self.here = cgroup_v2_path(Path("/proc/self/cgroup").read_text()) or "/"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _dir(self, cgroup: str) -> Path:
        return self.fs.mount / cgroup.lstrip("/")

    def process(self) -> int:
        proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL)
        self.procs[proc.pid] = proc
        return proc.pid

    def end(self, pid: int) -> None:
        proc = self.procs.pop(pid)
        proc.kill()
        proc.wait(timeout=10)

    def make(self, cgroup: str) -> None:
        self._dir(cgroup).mkdir(parents=True)

    def make_refusing(self, cgroup: str) -> None:
        """An invalid domain: a domain sibling of a threaded cgroup (EOPNOTSUPP). (Enabling a
        controller for a cgroup's children, the usual EBUSY case, needs one its parent
        offers; the test's parent may offer none.)"""
        parent = self._dir(cgroup).parent
        (parent / "threaded").mkdir(parents=True)
        (parent / "threaded" / "cgroup.type").write_text("threaded")
        self._dir(cgroup).mkdir()
        assert (self._dir(cgroup) / "cgroup.type").read_text().strip() == "domain invalid"

    def exists(self, cgroup: str) -> bool:
        return self._dir(cgroup).is_dir()

    def close(self) -> None:
        for pid in list(self.procs):
            self.end(pid)
        top = self._dir(self.base)
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            for _ in range(100):  # a killed process leaves its cgroup a moment after exiting
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


class FakeHarness(CgroupsHarness):
    def __init__(self) -> None:
        self.table = FakeProcessTable()
        self.fake = FakeCgroups(self.table, default="/init.scope")
        self.cgroups = self.fake
        self.base = "/ckptd-contract"
        self.fake.add(self.base)
        self.here = "/init.scope"
        self.next_pid = 5000

    def process(self) -> int:
        self.next_pid += 1
        self.table.add_process(self.next_pid, 1)
        return self.next_pid

    def end(self, pid: int) -> None:
        self.table.remove(pid)

    def make(self, cgroup: str) -> None:
        self.fake.add(cgroup)

    def make_refusing(self, cgroup: str) -> None:
        self.fake.add(cgroup)
        self.fake.busy.add(cgroup)

    def exists(self, cgroup: str) -> bool:
        return cgroup in self.fake.cgroups


def _real_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "moving processes between cgroups needs root"
    if CgroupFs.find() is None:
        return "no cgroup v2 hierarchy mounted here"
    return None


@pytest.fixture(params=["real", "fake"])
def h(request: pytest.FixtureRequest) -> Iterator[CgroupsHarness]:
    if request.param == "real":
        reason = _real_skip_reason()
        if reason:
            pytest.skip(reason)
        fs = CgroupFs.find()
        assert fs is not None
        harness: CgroupsHarness = RealCgroups(fs)
    else:
        harness = FakeHarness()
    try:
        yield harness
    finally:
        harness.close()


def test_a_new_process_is_in_its_parents_cgroup(h: CgroupsHarness) -> None:
    assert h.cgroups.cgroup_of(h.process()) == h.here


def test_move_puts_every_process_in_the_cgroup(h: CgroupsHarness) -> None:
    target = f"{h.base}/job"
    h.make(target)
    pids = [h.process(), h.process()]
    h.cgroups.move(pids, target)
    assert [h.cgroups.cgroup_of(p) for p in pids] == [target, target]
    if isinstance(h, RealCgroups):  # as the kernel says, for every thread
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                assert cgroup_v2_path((task / "cgroup").read_text()) == target


def test_move_with_create_makes_the_cgroup_and_its_parents(h: CgroupsHarness) -> None:
    target = f"{h.base}/jobs/train-r1"
    pid = h.process()
    h.cgroups.move([pid], target, create=True)
    assert h.cgroups.cgroup_of(pid) == target
    h.cgroups.move([pid], target, create=True)  # already there: still fine
    assert h.cgroups.cgroup_of(pid) == target


def test_move_into_a_missing_cgroup_fails_and_moves_nothing(h: CgroupsHarness) -> None:
    pid = h.process()
    with pytest.raises(CgroupUnavailable, match="does not exist"):
        h.cgroups.move([pid], f"{h.base}/missing")
    assert h.cgroups.cgroup_of(pid) == h.here
    assert not h.exists(f"{h.base}/missing")


def test_move_into_a_cgroup_that_takes_no_processes_fails_with_the_reason(
    h: CgroupsHarness,
) -> None:
    target = f"{h.base}/threads/b"
    h.make_refusing(target)
    pid = h.process()
    with pytest.raises(CgroupUnavailable, match=f"cgroup {target} takes no processes"):
        h.cgroups.move([pid], target)
    assert h.cgroups.cgroup_of(pid) == h.here


def test_a_gone_process_is_not_found(h: CgroupsHarness) -> None:
    pid = h.process()
    h.end(pid)
    with pytest.raises(ProcessNotFound):
        h.cgroups.cgroup_of(pid)
    h.make(f"{h.base}/job")
    with pytest.raises(ProcessNotFound):
        h.cgroups.move([pid], f"{h.base}/job")


def test_remove_empty_removes_only_empty_children(h: CgroupsHarness) -> None:
    for name in ("empty", "busy", "nested/inner"):
        h.make(f"{h.base}/{name}")
    pid = h.process()
    h.cgroups.move([pid], f"{h.base}/busy")
    assert h.cgroups.remove_empty(h.base) == [f"{h.base}/empty"]
    assert not h.exists(f"{h.base}/empty")
    assert all(h.exists(f"{h.base}/{n}") for n in ("busy", "nested", "nested/inner"))
    h.end(pid)
    deadline = time.monotonic() + 5
    while h.exists(f"{h.base}/busy") and time.monotonic() < deadline:
        h.cgroups.remove_empty(h.base)  # once its last process has left
    assert not h.exists(f"{h.base}/busy")
    assert h.cgroups.remove_empty(f"{h.base}/missing") == []


# ---- the real adapter's parsing ------------------------------------------------------------


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
52 40 0:38 /kubepods/pod1 /sys/fs/cgroup\\040x rw shared:9 - cgroup2 cgroup2 rw
"""


def test_cgroup2_mounts_and_the_hierarchys_root(tmp_path: Path) -> None:
    assert cgroup2_mounts(MOUNTINFO) == [
        ("/", Path("/sys/fs/cgroup/unified")),
        ("/kubepods/pod1", Path("/sys/fs/cgroup x")),
    ]
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    found = CgroupFs.find(mountinfo=info)
    assert found is not None and found.mount == Path("/sys/fs/cgroup/unified")
    info.write_text(MOUNTINFO.splitlines()[0] + "\n")
    assert CgroupFs.find(mountinfo=info) is None
    assert CgroupFs.find("/host/sys/fs/cgroup", info) is not None


def test_the_cgroup2_root_with_a_controller(tmp_path: Path) -> None:
    root = tmp_path / "cg root"
    root.mkdir()
    info = f"41 31 0:38 / {str(root).replace(' ', chr(92) + '040')} rw - cgroup2 cgroup2 rw\n"
    assert cgroup2_root_with("memory", info) is None  # no cgroup.controllers
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cgroup2_root_with("memory", info) == root
    assert cgroup2_root_with("hugetlb", info) is None  # a hybrid host's: on v1
    assert cgroup2_root_with("memory", "") is None
    # a namespaced mount (root not "/") is not the hierarchy's root
    assert cgroup2_root_with("memory", info.replace(" / ", " /kubepods/pod1 ", 1)) is None


def test_a_cgroup_outside_the_daemons_namespace_cannot_be_placed(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/../../kubepods/pod1/c1\n")
    (proc / "8").mkdir()
    (proc / "8" / "cgroup").write_text("4:memory:/x\n")
    fs = CgroupFs(tmp_path / "cg", proc)
    with pytest.raises(CgroupUnavailable, match="outside the daemon's cgroup namespace"):
        fs.cgroup_of(7)
    with pytest.raises(CgroupUnavailable, match="no cgroup v2"):
        fs.cgroup_of(8)
    with pytest.raises(CgroupUnavailable, match="not a cgroup path"):
        fs.move([7], "/a/../b")
