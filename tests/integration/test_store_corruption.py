"""Damaged store objects: ``verify`` names them, a restore refuses them, nothing else suffers.

Each test has its own store with two checkpoints: a bystander (``counter``, dumped first) and
the victim (``bigmem``, whose new pages go into a pack of their own: the largest). One object
of the victim is damaged on disk: a byte in the middle of its pack, a byte of its manifest,
the whole pack (deleted), a byte of the pack's magic, trailer checksum or end marker, or its
manifest replaced by the bystander's (ADR 0014). Then, with the daemon that wrote them
(caches warm) and again after a restart (everything read afresh from disk):

- ``ckptctl verify`` and ``ckptctl verify <victim>`` exit 1 and name the victim and the
  damaged object, and only those;
- ``ckptctl restore`` of the victim exits 1 with one line naming both; no process with the
  victim's pid appears, no output file or staging is left;
- the bystander verifies and restores;
- the restarted daemon's log names a pack whose footer or trailer is damaged.

And the store's secret and the manifest keys are root's alone, even in a store directory
that existed with mode 0755; a daemon given a key path with no file there, for a store whose
manifests another key signed, does not start (ADR 0014, "Amended").
"""

from __future__ import annotations

import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .flows import dump_killing
from .store_support import (
    Daemons,
    flip_byte,
    kill_pid,
    largest_pack,
    leftovers,
    store_files,
)
from .support import (
    CKPTD,
    CtlResult,
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    assert_same_lines,
    proc_state,
    reference,
    wait_for_lines,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

INTERVAL = 20


def bystander_cmd(steps: int) -> list[str]:
    return workload("counter", "--mem-mib", 2, "--steps", steps)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    ds = Daemons(tmp_path)
    try:
        yield ds
    finally:
        ds.close()


def assert_verify_names(res: CtlResult, victim: str, obj: str, bystander: str) -> None:
    """``verify`` failed and named the victim and ``obj``, and no problem of the bystander
    (it may be named as what the victim's manifest was copied from: ``obj``)."""
    assert res.rc == 1, f"verify of a damaged store exited {res.rc}: {res.out!r} {res.err!r}"
    report = assert_ok(CtlResult(0, res.out, res.err), "verify")
    assert report["ok"] is False
    problems = report["problems"]
    assert any(victim in p and obj in p for p in problems), (
        f"no problem names both checkpoint {victim} and {obj}: {problems}"
    )
    assert not any(bystander in p.replace(obj, "") for p in problems), (
        f"the bystander is intact: {problems}"
    )


def assert_nothing_restored(d: Daemon, ck: dict[str, Any]) -> None:
    for _ in range(3):
        assert proc_state(ck["pid"]) is None, (
            f"pid {ck['pid']} appeared although the restore of {ck['id']} was refused"
        )
        time.sleep(0.1)
    outputs = sorted((d.state_dir / "output").glob(f"{ck['id']}*"))
    assert not outputs, f"a refused restore left output files {outputs}"
    assert not leftovers(d.store, d.state_dir), leftovers(d.store, d.state_dir)


def assert_restore_refused(d: Daemon, ck: dict[str, Any], obj: str, listed: bool) -> None:
    """``restore <id>`` and ``restore <pid>`` both refuse; the latter resolves to the damaged
    checkpoint if it is still listed (else there is no checkpoint of that pid)."""
    res = d.ctl("restore", ck["id"])
    assert_one_line_error(res, 1, ck["id"], obj)
    assert_nothing_restored(d, ck)
    res = d.ctl("restore", ck["pid"])
    if listed:
        assert_one_line_error(res, 1, ck["id"], obj)
    else:
        assert res.rc != 0, f"restore {ck['pid']}: exit 0 with no checkpoint listed: {res.out}"
        assert_one_line_error(res, res.rc, f"no checkpoint of pid {ck['pid']}")
    assert_nothing_restored(d, ck)


def restore_bystander(
    d: Daemon, procs: Procs, ck: dict[str, Any], pre: list[str], ref: list[str]
) -> None:
    res = assert_ok(d.ctl("restore", ck["id"]), "restore of the bystander")
    procs.add(res["pid"])
    post = wait_for_lines(Path(res["output_path"]), 3)[:3]
    assert_same_lines(pre + post, ref[: len(pre) + 3], "bystander before the dump + restored")
    kill_pid(res["pid"])


@pytest.mark.parametrize("damage", ["pack-byte", "manifest-byte", "pack-missing",
                                    "pack-trailer", "pack-magic", "pack-end-marker",
                                    "manifest-swapped"])
def test_damaged_object_is_named_and_never_restored(
    daemons: Daemons, procs: Procs, damage: str
) -> None:
    d = daemons.start()
    ref = reference(with_interval(bystander_cmd(60), 0))
    bystander, pre = dump_killing(d, procs, bystander_cmd(0))
    packs_before = set(store_files(d.store, "packs"))
    victim, _ = dump_killing(d, procs, workload("bigmem", "--mib", 32, "--steps", 0))
    pack = largest_pack(d.store)
    assert pack not in packs_before, "the victim's pages must be in a pack of their own"
    manifest = d.store / "manifests" / victim["id"]
    obj = {
        "manifest-byte": "manifest", "manifest-swapped": f"manifest of checkpoint "
        f"{bystander['id']}", "pack-magic": "bad magic", "pack-end-marker": "end marker",
        "pack-trailer": "trailer checksum",
    }.get(damage, pack.name)
    unlisted = damage in ("manifest-byte", "manifest-swapped")

    if damage == "pack-byte":
        flip_byte(pack, pack.stat().st_size // 2)
    elif damage == "manifest-byte":
        flip_byte(manifest, manifest.stat().st_size // 2)
    elif damage == "pack-missing":
        pack.unlink()
    elif damage == "pack-magic":
        flip_byte(pack, 0)
    elif damage == "pack-end-marker":
        flip_byte(pack, -1)
    elif damage == "manifest-swapped":
        manifest.write_bytes((d.store / "manifests" / bystander["id"]).read_bytes())
    else:
        flip_byte(pack, -9)  # in the footer: the trailer's checksum

    # The daemon that wrote everything, its caches warm (the pack's index in memory): the
    # pack's structure is read again by verify and by the restore.
    assert_verify_names(d.ctl("verify"), victim["id"], obj, bystander["id"])
    assert_verify_names(d.ctl("verify", victim["id"]), victim["id"], obj, bystander["id"])
    assert_restore_refused(d, victim, obj, listed=not unlisted)
    listed = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
    if unlisted:
        assert listed == [bystander["id"]], "a checkpoint is listed iff its manifest is intact"
    else:
        assert listed == [bystander["id"], victim["id"]]
    assert assert_ok(d.ctl("verify", bystander["id"]), "verify of the bystander")["ok"]
    daemons.stop(d)

    # A new daemon on the same store: everything is read afresh from disk. It must start
    # (a damaged pack is no reason not to serve the others).
    d = daemons.start()
    if damage in ("pack-trailer", "pack-end-marker"):  # the start-up check reads footers
        assert any("damaged store object" in line and pack.name in line and obj in line
                   for line in d.log().splitlines()), d.log()[-3000:]
        assert "1 damaged" in d.log(), d.log()[-3000:]
    assert_verify_names(d.ctl("verify"), victim["id"], obj, bystander["id"])
    assert_verify_names(d.ctl("verify", victim["id"]), victim["id"], obj, bystander["id"])
    assert_restore_refused(d, victim, obj, listed=not unlisted)
    restore_bystander(d, procs, bystander, pre, ref)
    assert not leftovers(d.store, d.state_dir), leftovers(d.store, d.state_dir)
    daemons.stop(d)


def test_the_store_secret_and_manifest_keys_are_root_only(daemons: Daemons) -> None:
    """A store directory that existed with mode 0755 (and a store.json an older ckptd left
    0644 there) is made private at start; the key file the daemon creates is 0600."""
    keys = daemons.root / "keys" / "manifest.keys"
    daemons.store.mkdir(mode=0o755)
    daemons.store.chmod(0o755)
    d = daemons.start("--manifest-keys", str(keys))
    daemons.stop(d)
    (daemons.store / "store.json").chmod(0o644)
    d = daemons.start("--manifest-keys", str(keys))
    assert stat.S_IMODE((daemons.store / "store.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(daemons.store.stat().st_mode) == 0o700
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.parent.stat().st_mode) == 0o700
    daemons.stop(d)


def test_a_mistyped_manifest_key_path_refuses_to_start_and_creates_nothing(
    daemons: Daemons, procs: Procs
) -> None:
    """A key path with no file there (a typo, a wiped state dir), for a store holding a
    manifest another key signed: exit 2 with one line, no key created (a new one would hide
    every checkpoint). The right key file still serves the checkpoint."""
    keys = daemons.root / "keys" / "manifest.keys"
    d = daemons.start("--manifest-keys", str(keys))
    ck, _pre = dump_killing(d, procs, bystander_cmd(0))
    daemons.stop(d)

    typo = daemons.root / "kyes" / "manifest.keys"
    proc = subprocess.run(
        [str(CKPTD), "--socket", str(daemons.root / "typo" / "ckptd.sock"), "--store",
         str(daemons.store), "--state-dir", str(daemons.state_dir), "--manifest-keys",
         str(typo), "--jobs-cgroup", ""],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ckptd:")]
    assert len(lines) == 1, proc.stderr
    assert str(typo) in lines[0] and "1 manifest(s) signed with keys this node lacks" in (
        lines[0]), lines[0]
    assert "--manifest-keys" in lines[0], lines[0]
    assert not typo.parent.exists()

    d = daemons.start("--manifest-keys", str(keys))
    assert [c["id"] for c in assert_ok(d.ctl("list"), "list")] == [ck["id"]]
    assert "1 signed with a key this node holds, 0 signed with keys this node lacks" in (
        d.log()), d.log()[-3000:]
    daemons.stop(d)
