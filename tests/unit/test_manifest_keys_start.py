"""The manifest key at the daemon's start (issue 21, point 7; ADR 0014, "Amended").

- a key is never created for a store that holds manifests signed with a key (format 2): a
  mistyped ``--manifest-keys`` or a wiped state dir stops the start in one line, creating
  nothing;
- an unauthenticated (format 1) manifest — written before ckptd signed manifests, or planted
  — is adopted only with ``adopt_unauthenticated``, never because a key file was created;
  without it, it stays unlisted and the start log counts it and names the setting;
- the start log counts the manifests signed with keys this node lacks;
- a key file that is a FIFO, a directory, a device or a link, that group or others may use,
  or that is not the daemon's user's is refused at once, without blocking.

Real stores on local disk, real key files, the daemon's own start-up functions; the start
itself (``Daemon.run``) runs in a child process with a timeout, so a start that blocks or that
goes on serving fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import xxhash

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore, keyfile
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.store.objects import manifest_key
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.main import _check_store
from ckptd.daemon.wiring import manifest_keys
from ckptd.domain import CheckpointRecord
from ckptd.testing import FakeClock

from .store.support import checkout, commit, images, make_pages

START_TIMEOUT_S = 30.0
"""A refused start takes well under a second; one that blocks or serves is killed here."""

START = (
    "import sys\n"
    "from ckptd.daemon.config import load\n"
    "from ckptd.daemon.main import Daemon, parse_args\n"
    "sys.exit(Daemon(load(parse_args(sys.argv[1:]))).run())\n"
)
"""The daemon's start (``main`` less its root check: the refusals come before anything
needs root)."""


def _files(seed: int) -> dict[str, bytes]:
    return images(make_pages(["random"] * 8 + ["zero"] * 2, seed), seed)


class Node:
    """A store on local disk under ``root`` and the config of a daemon on it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store_dir = root / "store"
        self.state_dir = root / "state"
        self.keys_path = root / "etc" / "manifest.keys"
        self.blobs = LocalBlobStore(self.store_dir)
        self.clock = FakeClock()

    def config(self, keys_path: Path | None = None, **settings: bool) -> DaemonConfig:
        return DaemonConfig(
            store=str(self.store_dir), state_dir=self.state_dir,
            manifest_keys=str(keys_path or self.keys_path), **settings,
        )

    def store(self, keys: ManifestKeys) -> ContentStore:
        return ContentStore(self.blobs, StagingPolicy(None, self.root / "staging"),
                            clock=self.clock, is_pages_file=is_pages_image, keys=keys)

    def start(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Start the daemon on this store (its own flags, then ``args``); it must end by
        itself within START_TIMEOUT_S."""
        argv = ["--socket", str(self.root / "run" / "ckptd.sock"), "--store",
                str(self.store_dir), "--state-dir", str(self.state_dir), "--jobs-cgroup", "",
                *args]
        try:
            return subprocess.run(
                [sys.executable, "-c", START, *argv], capture_output=True, text=True,
                timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the daemon neither refused nor ended within {START_TIMEOUT_S}s "
                        f"(blocked, or serving): {exc.stderr!r}")


def _refused_in_one_line(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("ckptd:")]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def _legacy(data: bytes) -> bytes:
    """``data`` rewritten as a format-1 manifest (xxh3 checksum, no MAC): what ckptd wrote
    before ADR 0014, or what someone without the key can plant."""
    body = json.loads(data.rstrip(b"\n").rpartition(b"\n")[0])
    body = {k: v for k, v in body.items() if k not in ("id", "store")} | {"format": 1}
    raw = json.dumps(body, sort_keys=True).encode()
    return raw + b"\n" + xxhash.xxh3_128_hexdigest(raw).encode() + b"\n"


def _plant_legacy(node: Node, seed: int) -> CheckpointRecord:
    """A checkpoint whose manifest is format 1 (its objects written by a node with a key
    nobody keeps)."""
    rec = commit(node.store(ManifestKeys.generate()), node.clock, _files(seed))
    key = manifest_key(rec.id)
    node.blobs.put(key, _legacy(node.blobs.get(key)))
    return rec


# ---- no key is created for a store signed by another ------------------------------------


@pytest.mark.parametrize("how", ["mistyped-path", "wiped-state-dir"])
def test_a_missing_key_file_for_a_signed_store_refuses_to_start_and_creates_nothing(
    tmp_path: Path, how: str
) -> None:
    node = Node(tmp_path)
    keys, created = keyfile.load_or_create(node.keys_path)
    assert created
    store = node.store(keys)
    for seed in (1, 2):
        commit(store, node.clock, _files(seed))
    if how == "mistyped-path":
        missing = tmp_path / "ect" / "manifest.keys"  # a typo: nothing there
        res = node.start("--manifest-keys", str(missing))
        assert not missing.parent.exists()
    else:  # the default key path, in a state dir that was wiped
        missing = node.state_dir / "manifest.keys"
        res = node.start()
    line = _refused_in_one_line(
        res, str(missing), str(node.store_dir), "holds 2 manifest(s) signed with keys this "
        "node lacks", f"2 by key {keys.signing_id}", "not creating a new key",
        "--manifest-keys", "another node",
    )
    assert "Errno" not in line
    assert not missing.exists()
    assert [p.name for p in (tmp_path / "etc").iterdir()] == ["manifest.keys"]
    # the right key file still reads every checkpoint
    assert len(node.store(keyfile.load_or_create(node.keys_path)[0]).list()) == 2


def test_a_key_is_created_for_a_store_with_no_signed_manifest(tmp_path: Path) -> None:
    node = Node(tmp_path)
    _plant_legacy(node, 1)  # format 1 does not count: it names no key
    keys, created = manifest_keys(node.config(), node.blobs)
    assert created
    assert stat.S_IMODE(node.keys_path.stat().st_mode) == 0o600
    assert manifest_keys(node.config(), node.blobs) == (keys, False)


# ---- format 1 is adopted only when asked ---------------------------------------------------


def test_a_planted_unauthenticated_manifest_is_not_adopted_without_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path)
    planted = _plant_legacy(node, 1)
    before = node.blobs.get(manifest_key(planted.id))
    keys, created = manifest_keys(node.config(), node.blobs)  # a first start: a new key
    assert created
    store = node.store(keys)
    with caplog.at_level(logging.INFO, logger="ckptd"):
        _check_store(node.config(), store)
    assert store.list() == []
    assert node.blobs.get(manifest_key(planted.id)) == before  # not signed
    [line] = [r.getMessage() for r in caplog.records if "unadopted" in r.getMessage()]
    assert "1 unauthenticated manifest(s)" in line
    assert "adopt_unauthenticated = true" in line and "--adopt-unauthenticated" in line
    assert not any("signed 1 manifest" in r.getMessage() for r in caplog.records)


def test_an_unauthenticated_manifest_is_adopted_with_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path)
    legacy = _plant_legacy(node, 1)
    keys, _created = manifest_keys(node.config(), node.blobs)
    store = node.store(keys)
    with caplog.at_level(logging.INFO, logger="ckptd"):
        _check_store(node.config(adopt_unauthenticated=True), store)
    assert [r.id for r in store.list()] == [legacy.id]
    assert checkout(store, legacy.id) == _files(1)
    messages = [r.getMessage() for r in caplog.records]
    assert any("signed 1 manifest(s)" in m and legacy.id in m for m in messages), messages
    assert not any("unadopted" in m for m in messages), messages
    assert any("1 signed with a key this node holds" in m for m in messages), messages


def test_the_adopt_flag_reaches_the_config() -> None:
    from ckptd.daemon.config import load
    from ckptd.daemon.main import parse_args

    assert load(parse_args(["--adopt-unauthenticated"])).adopt_unauthenticated is True
    assert load(parse_args([])).adopt_unauthenticated is False


# ---- the start log counts manifests signed with keys this node lacks ---------------------


def test_the_start_log_counts_manifests_signed_with_keys_this_node_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path)
    mine, theirs = ManifestKeys.generate(), ManifestKeys.generate()
    for seed, keys in ((1, mine), (2, mine), (3, theirs)):
        commit(node.store(keys), node.clock, _files(seed))
    _plant_legacy(node, 4)
    store = node.store(mine)
    with caplog.at_level(logging.INFO, logger="ckptd"):
        _check_store(node.config(), store)
    [line] = [r for r in caplog.records if r.getMessage().startswith("manifests in the store")]
    text = line.getMessage()
    assert "2 signed with a key this node holds" in text
    assert "1 signed with keys this node lacks" in text and f"1 by key {theirs.signing_id}" in text
    assert "1 unauthenticated (format 1)" in text and "0 damaged" in text
    assert line.levelno == logging.WARNING
    assert len(store.list()) == 2


def test_the_start_log_of_a_store_this_node_reads_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp_path)
    keys = ManifestKeys.generate()
    commit(node.store(keys), node.clock, _files(1))
    with caplog.at_level(logging.INFO, logger="ckptd"):
        _check_store(node.config(), node.store(keys))
    [line] = [r for r in caplog.records if r.getMessage().startswith("manifests in the store")]
    assert "1 signed with a key this node holds, 0 signed with keys this node lacks" in (
        line.getMessage())
    assert line.levelno == logging.INFO
    assert not any("unadopted" in r.getMessage() for r in caplog.records)


# ---- key files that are not safe to use ---------------------------------------------------


def test_a_fifo_key_file_refuses_the_start_at_once(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.keys_path.parent.mkdir(mode=0o700)
    os.mkfifo(node.keys_path, 0o600)
    line = _refused_in_one_line(node.start("--manifest-keys", str(node.keys_path)),
                                str(node.keys_path), "not a regular file", "a FIFO")
    assert "--manifest-keys" in line
    assert stat.S_ISFIFO(node.keys_path.lstat().st_mode)  # left as it was


def _load_at_once(path: Path) -> BaseException | None:
    """``keyfile.load(path)`` in a thread that must end within 10 s: what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            keyfile.load(path)
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        if stat.S_ISFIFO(path.lstat().st_mode):  # let the blocked open go
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"loading key file {path} blocked")
    return raised[0] if raised else None


def _make(path: Path, kind: str) -> None:
    good = keyfile.HEADER + ManifestKeys.generate().keys[0].hex() + "\n"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    elif kind in ("symlink", "dangling-symlink"):
        target = path.with_name("real.keys")
        if kind == "symlink":
            target.write_text(good)
            target.chmod(0o600)
        path.symlink_to(target)
    else:
        path.write_text(good)
        path.chmod({"group-readable": 0o640, "other-writable": 0o602,
                    "not-owned": 0o600}[kind])
        if kind == "not-owned":
            if os.geteuid() != 0:
                pytest.skip("giving a file to another user needs root")
            os.chown(path, 65534, 65534)


@pytest.mark.parametrize("kind, what", [
    ("fifo", "is not a regular file (it is a FIFO)"),
    ("directory", "is not a regular file (it is a directory)"),
    ("device", "is not a regular file (it is a character device)"),
    ("symlink", "is a symbolic link"),
    ("dangling-symlink", "is a symbolic link"),
    ("group-readable", "has mode 640"),
    ("other-writable", "has mode 602"),
    ("not-owned", "is owned by uid 65534"),
])
def test_an_unsafe_key_file_is_refused_at_once_never_repaired(
    tmp_path: Path, kind: str, what: str
) -> None:
    path = tmp_path / "manifest.keys"
    _make(path, kind)
    before = path.lstat()
    exc = _load_at_once(path)
    assert isinstance(exc, ValueError), exc
    line = str(exc)
    assert "\n" not in line
    assert line.startswith(f"manifest key file {path} {what}"), line
    assert "refused" in line and ("manifest_keys" in line or "chmod 600" in line), line
    after = path.lstat()
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)  # left alone
