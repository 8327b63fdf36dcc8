"""Files put back as root into a real runc/crun container cannot be redirected onto the node
(issue 21, point 4).

A restore into a container puts the job's files back through the container's root, as root.
The container owns every directory of its file system and can change any of them at any
moment: here its init, the container's root, swaps the directory ``/data/sub`` of its volume
for an absolute symbolic link to a directory of the *node* (``tmp_path/node-target``: an
absolute link followed from the node's side resolves against the daemon's root), atomically
and continuously (``renameat2(RENAME_EXCHANGE)``: ``/data/sub`` is always one or the other),
while the test checks, puts back and undoes ``/data/sub/train.log`` through
``ProcJobFiles().seen_by(init)`` (the container's root, pinned once) hundreds of times. The
old check-then-use code (``in_root``: ``lstat`` each component, then open the path) wrote
on the node within a few tries; what holds now: nothing on the node is ever created, changed
or removed, and every put-back either lands in the volume or is refused as a symbolic link.

The captured file is captured through the container with the real adapter: the container's
init has ``/data/sub/train.log`` open for writing, ``written``/``capture`` read it from
``/proc``, as a checkpoint does.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.adapters.procfs.jobfiles import ProcJobFiles
from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.adapters.procfs.safefs import SYS_RENAMEAT2
from ckptd.core.ports import PutBack
from ckptd.domain import CapturedFile

from .bundle import ContainerSpec, build_rootfs
from .runtime import OciContainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHECKPOINTED = b"step 1: loss 0.91\n" * 300
"""What the job had written at the checkpoint (what a restore puts back)."""
NEWER = b"the container's own later version\n" * 20
"""What ``train.log`` holds in the volume at the restore (``present``: set aside, undone)."""
NODES_OWN = b"a file of the node's, not the container's\n"
"""A file on the node where the link points (``present``): never to be touched."""
ASIDE = "/data/sub/train.log.ckptd-r1"

ATTACKER = r"""
import ctypes, os, sys, time
mode, node_target, nr = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs('/data/sub', exist_ok=True)
log = open('/data/sub/train.log', 'wb')
log.write(bytes.fromhex(sys.argv[4]))
log.flush()
print('writing', flush=True)
while not os.path.exists('/data/go'):
    time.sleep(0.01)
log.close()
if mode == 'missing':
    os.unlink('/data/sub/train.log')
else:
    with open('/data/sub/train.log', 'wb') as f:
        f.write(bytes.fromhex(sys.argv[5]))
os.symlink(node_target, '/data/sub.swap')
libc = ctypes.CDLL(None, use_errno=True)
swap = lambda: libc.syscall(nr, -100, b'/data/sub', -100, b'/data/sub.swap', 2)
swaps = 0
print('swapping', flush=True)
while not os.path.exists('/data/stop'):
    for _ in range(64):
        if swap() != 0:
            print('swap failed', ctypes.get_errno(), flush=True)
            sys.exit(3)
    swaps += 64
if not os.path.islink('/data/sub'):
    swap()
print('stopped with the link in place after', swaps, 'swaps', flush=True)
time.sleep(3600)
"""
"""The container's init (root in the container): writes the job's log (captured), then on
``/data/go`` leaves the volume as ``mode`` says and exchanges ``/data/sub`` (a directory)
with ``/data/sub.swap`` (an absolute link to the node's directory) until ``/data/stop``;
stops with the link at ``/data/sub``."""


def _snapshot(top: Path) -> dict[str, tuple[int, int, int, int, str]]:
    """Everything under ``top``: each entry's type, inode, mtime, ctime and content hash."""
    seen: dict[str, tuple[int, int, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            digest = (hashlib.sha256(path.read_bytes()).hexdigest()
                      if stat.S_ISREG(st.st_mode) else "")
            seen[str(path.relative_to(top))] = (stat.S_IFMT(st.st_mode), st.st_ino,
                                                st.st_mtime_ns, st.st_ctime_ns, digest)
    return seen


def _read_in(dirfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dirfd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


@pytest.fixture
def attacked(rootfs: Path, tmp_path: Path, request: pytest.FixtureRequest
             ) -> Iterator[tuple[str, OciContainer, int, Path, Path]]:
    """A runc/crun container with the volume ``tmp_path/volume`` at ``/data`` whose init
    runs ``ATTACKER``: (mode, container, its init's node pid, the volume, the node's
    target)."""
    mode = request.param
    volume, node_target = tmp_path / "volume", tmp_path / "node-target"
    volume.mkdir()
    node_target.mkdir()
    if mode == "present":
        (node_target / "train.log").write_bytes(NODES_OWN)
    assert SYS_RENAMEAT2, "renameat2's number on this architecture"
    name = f"ckptd-paths-{os.getpid()}-{mode}"
    c = OciContainer(name, tmp_path / "bundle", ContainerSpec(
        rootfs=rootfs, hostname="paths", volumes={volume: Path("/data")},
        cgroups_path=f"/ckptd-test/{name}",
        args=["python3", "-c", ATTACKER, mode, str(node_target), str(SYS_RENAMEAT2),
              CHECKPOINTED.hex(), NEWER.hex()]))
    try:
        init = c.run()
        c.wait_for_output("writing", timeout=30)
        yield mode, c, init, volume, node_target
    finally:
        c.delete()


@pytest.mark.parametrize("attacked", ["missing", "present"], indirect=True)
def test_a_volume_directory_swapped_for_an_absolute_symlink_never_lets_root_write_on_the_node(
    attacked: tuple[str, OciContainer, int, Path, Path], tmp_path: Path
) -> None:
    """``missing``: the file is gone from the volume (a put-back creates it, the undo removes
    it); ``present``: the volume holds a later version and the node's directory a file of
    the same name (a put-back sets the version aside and overwrites; the undo restores)."""
    mode, c, init, volume, node_target = attacked
    missing = mode == "missing"
    (written,) = ProcJobFiles().written(ProcFsTable().tree(init))
    assert written.path == "/data/sub/train.log"
    captured = ProcJobFiles().capture(written, tmp_path / "img")
    assert isinstance(captured, CapturedFile) and captured.size == len(CHECKPOINTED)
    content = tmp_path / "img"
    # the real directory, held by fd on the node: wherever the swaps leave its name
    real = os.open(volume / "sub", os.O_PATH | os.O_DIRECTORY)
    node_before = _snapshot(node_target)
    (volume / "go").touch()
    c.wait_for_output("swapping", timeout=30)
    view = ProcJobFiles().seen_by(init)  # the container's root, pinned here
    outcomes = {"put back": 0, "refused": 0}
    checks = {"ok": 0, "symlink": 0}
    undo_refusals = 0
    started = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - started
            tries = sum(outcomes.values())
            if tries >= 200 and elapsed >= 1 and all(outcomes.values()) and checks[
                    "symlink"]:
                break
            assert elapsed < 20, (outcomes, checks, "the swaps never raced the put-back")
            check = view.check(captured, 0, 0)
            assert check.differs
            if check.problem:
                assert "symbolic link" in check.problem, check
                checks["symlink"] += 1
            else:
                checks["ok"] += 1
            journaled: list[PutBack] = []
            try:
                done = view.put_back(captured, content, ASIDE, 0, 0, journaled.append)
            except OSError as exc:
                assert _snapshot(node_target) == node_before, f"written on the node: {exc}"
                assert "symbolic link" in str(exc), exc
                outcomes["refused"] += 1
                continue
            assert _snapshot(node_target) == node_before, "root wrote on the node"
            assert done is not None and done.path == "/data/sub/train.log", done
            # journaled before the aside exists: its identity is the put-back's to record
            assert journaled and replace(journaled[-1], aside_ino=done.aside_ino,
                                         aside_uid=done.aside_uid) == done
            assert _read_in(real, "train.log") == CHECKPOINTED  # in the volume
            if missing:
                assert not done.aside
            else:
                assert done.aside == ASIDE
                assert _read_in(real, "train.log.ckptd-r1") == NEWER
            outcomes["put back"] += 1
            for _ in range(10_000):  # through the same pinned view, raced by the swaps
                try:
                    view.undo(done, 0, 0)
                    break
                except OSError as exc:
                    assert "symbolic link" in str(exc), exc
                    undo_refusals += 1
                finally:
                    assert _snapshot(node_target) == node_before, "undo acted on the node"
            else:
                pytest.fail("undo never got through")
            assert _read_in(real, "train.log") == (None if missing else NEWER), (
                "the undo left the volume's file as put back: it acted elsewhere")
            assert _read_in(real, "train.log.ckptd-r1") is None
        # the link left in place: reported, refused, and the node untouched
        (volume / "stop").touch()
        c.wait_for_output("stopped with the link in place", timeout=30)
        check = view.check(captured, 0, 0)
        assert check.differs and "symbolic link" in check.problem, check
        with pytest.raises(OSError, match="symbolic link"):
            view.put_back(captured, content, ASIDE, 0, 0, journaled.append)
        assert _snapshot(node_target) == node_before
        assert os.readlink(volume / "sub") == str(node_target)  # so the directory is:
        assert sorted(os.listdir(volume / "sub.swap")) == ([] if missing else ["train.log"])
    finally:
        os.close(real)
    print(f"\n{outcomes}, checks {checks}, undo refused {undo_refusals} times, "
          f"{time.monotonic() - started:.1f}s")


def test_the_container_root_is_never_left_through_dotdot_or_a_symlink(
    tmp_path: Path
) -> None:
    """A container whose own root file system has ``/data -> /`` and ``/up`` -> ``..``
    enough times to climb out of it, and a log that is itself an absolute link to the node:
    each path that would leave the container's root (followed from the node: the absolute
    link against the daemon's root, ``..`` above the container's root into the node's
    directories) is refused by ``check`` and ``put_back``, and the node is untouched; a plain
    path in the same container is put back (the refusals are not a broken view)."""
    rootfs = tmp_path / "rootfs"
    build_rootfs(rootfs)  # its own: the session's is shared
    node_target = tmp_path / "node-target"
    node_target.mkdir()
    (rootfs / "data").rmdir()
    (rootfs / "data").symlink_to("/")
    depth = len(rootfs.parts)
    (rootfs / "up").symlink_to("/".join([".."] * depth))
    (rootfs / "var" / "train.log").symlink_to(node_target / "train.log")
    name = f"ckptd-paths-{os.getpid()}-root"
    c = OciContainer(name, tmp_path / "bundle", ContainerSpec(
        rootfs=rootfs, hostname="paths", args=["sleep", "3600"],
        cgroups_path=f"/ckptd-test/{name}"))
    content = tmp_path / "img"
    content.write_bytes(CHECKPOINTED)
    journaled: list[PutBack] = []

    def captured_at(path: str) -> CapturedFile:  # as a checkpoint of the job would say
        return CapturedFile(path=path, size=len(CHECKPOINTED), mode=0o644, uid=0, gid=0,
                            hash="0" * 32, image="img")

    link, dotdot = "symbolic link", "'..'"
    escapes = {  # path: (what check says, what put_back says)
        f"/data{node_target}/train.log": (link, link),
        f"/up{node_target}/train.log": (link, link),
        f"/tmp/..{node_target}/train.log": (dotdot, dotdot),
        f"/../../../..{node_target}/train.log": (dotdot, dotdot),
        # the file itself a link: found, not a regular file (O_PATH), never opened through
        "/var/train.log": ("no longer a regular file", link),
    }
    try:
        init = c.run()
        for _ in range(500):
            if (Path(f"/proc/{init}/root") / "up").is_symlink():
                break
            time.sleep(0.01)
        view = ProcJobFiles().seen_by(init)
        for path, (check_says, put_back_says) in escapes.items():
            captured = captured_at(path)
            check = view.check(captured, 0, 0)
            assert check.differs and check_says in check.problem, (path, check)
            with pytest.raises(OSError, match=put_back_says):
                view.put_back(captured, content, path + ".ckptd-r1", 0, 0,
                              journaled.append)
            assert os.listdir(node_target) == [], path
        done = view.put_back(captured_at("/tmp/train.log"), content, "/tmp/train.log.r1", 0,
                             0, journaled.append)
        assert done is not None and not done.aside
        assert Path(f"/proc/{init}/root/tmp/train.log").read_bytes() == CHECKPOINTED
        view.undo(done, 0, 0)
        assert not Path(f"/proc/{init}/root/tmp/train.log").exists()
    finally:
        c.delete()
    assert os.listdir(node_target) == []
