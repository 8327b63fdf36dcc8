"""Damaged store objects: ``verify`` names them, a restore refuses them, nothing else suffers.

Each test has its own store with two checkpoints: a bystander (``counter``, dumped first) and
the victim (``bigmem``, whose new pages go into a pack of their own: the largest). One object
of the victim is damaged on disk: a byte in the middle of its pack, a byte of its manifest,
the whole pack (deleted), or a byte of the pack's trailer. Then, with the daemon that wrote
them (caches warm; for the trailer, see the test) and again after a restart (everything read
afresh from disk):

- ``ckptctl verify`` exits 1 and names the victim and the damaged object, and only those;
- ``ckptctl restore`` of the victim exits 1 with one line naming both; no process with the
  victim's pid appears, no output file or staging is left;
- the bystander verifies and restores.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .store_support import (
    Daemons,
    flip_byte,
    kill_pid,
    largest_pack,
    leftovers,
    store_files,
)
from .support import (
    CtlResult,
    Daemon,
    LineReader,
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


def dump_killing(d: Daemon, procs: Procs, cmd: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Run ``cmd`` (stdout on a pipe), dump it after 3 lines (which kills it); returns the
    checkpoint and the lines printed before the dump."""
    proc = procs.popen(
        with_interval(cmd, INTERVAL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    reader.read_lines(3, timeout=30)
    ck = assert_ok(d.ctl("dump", proc.pid), "dump")
    pre = reader.read_to_eof()
    proc.wait(timeout=10)
    return ck, pre


def assert_verify_names(res: CtlResult, victim: str, obj: str, bystander: str) -> None:
    assert res.rc == 1, f"verify of a damaged store exited {res.rc}: {res.out!r} {res.err!r}"
    report = assert_ok(CtlResult(0, res.out, res.err), "verify")
    assert report["ok"] is False
    problems = report["problems"]
    assert any(victim in p and obj in p for p in problems), (
        f"no problem names both checkpoint {victim} and {obj}: {problems}"
    )
    assert not any(bystander in p for p in problems), f"the bystander is intact: {problems}"


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
                                    "pack-trailer"])
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
    obj = {"manifest-byte": "manifest"}.get(damage, pack.name)

    if damage == "pack-byte":
        flip_byte(pack, pack.stat().st_size // 2)
    elif damage == "manifest-byte":
        flip_byte(manifest, manifest.stat().st_size // 2)
    elif damage == "pack-missing":
        pack.unlink()
    else:
        flip_byte(pack, -30)  # in the footer: the trailer's checksum

    # The daemon that wrote everything, its caches warm. A damaged trailer: this daemon has
    # the pack's index in memory and every page still matches its hash, so only the check of
    # every trailer (whole-store verify) sees it; a restarted daemon cannot index the pack.
    assert_verify_names(d.ctl("verify"), victim["id"] if damage != "pack-trailer" else "",
                        obj, bystander["id"])
    if damage != "pack-trailer":
        assert_verify_names(d.ctl("verify", victim["id"]), victim["id"], obj, bystander["id"])
        assert_restore_refused(d, victim, obj, listed=damage != "manifest-byte")
    listed = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
    if damage == "manifest-byte":
        assert listed == [bystander["id"]], "a checkpoint is listed iff its manifest is intact"
    else:
        assert listed == [bystander["id"], victim["id"]]
    assert assert_ok(d.ctl("verify", bystander["id"]), "verify of the bystander")["ok"]
    daemons.stop(d)

    # A new daemon on the same store: everything is read afresh from disk. It must start
    # (a damaged pack is no reason not to serve the others).
    d = daemons.start()
    assert_verify_names(d.ctl("verify"), victim["id"], obj, bystander["id"])
    assert_verify_names(d.ctl("verify", victim["id"]), victim["id"], obj, bystander["id"])
    assert_restore_refused(d, victim, obj, listed=damage != "manifest-byte")
    restore_bystander(d, procs, bystander, pre, ref)
    assert not leftovers(d.store, d.state_dir), leftovers(d.store, d.state_dir)
    daemons.stop(d)
