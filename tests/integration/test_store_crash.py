"""The daemon SIGKILLed in the middle of a dump or of a GC; the next daemon on the same store
and state directory recovers.

Dumps: each iteration starts a daemon and a ``bigmem`` job, asks for a dump (with and without
``--leave-running``, alternately) and SIGKILLs the daemon after a random delay — a seeded
random: the seed is printed, ``CKPTD_CRASH_SEED=<seed>`` replays the same delays. Three more
iterations kill it at chosen points: while CRIU holds the tree (ptrace; CRIU, left alone, then
fails and lets go), right after CRIU has dumped (the tree is stopped, nothing is committed)
and right after the manifest is written (committed, the tree not yet released: the daemon's
guard, told only that the commit was under way, resumes the tree and the next daemon deletes
the checkpoint: docs/adr/0016).
Then a new daemon starts on the same directories and, once any CRIU the dead daemon left has
finished on its own:

- the dump is either committed or it is not. Not committed: the job runs on, not stopped, and
  makes progress. Committed without ``--leave-running``: the job is gone, killed. A dump that
  ckptctl reported as done is always committed;
- ``ckptctl list`` shows only whole checkpoints: ``ckptctl verify`` is clean and checks
  exactly those, and a committed checkpoint of the iteration is really restored (the job
  killed first) and goes on from its dump point, line for line;
- no ``.tmp.`` file, staging or restore directory, lease or journal entry is left.

GC: checkpoints to keep, garbage (deleted checkpoints, and checkpoints beyond retention), then
``ckptctl gc --keep-last 1 --name junk`` with the daemon SIGKILLed after a random number of
deletions. The next daemon: verify clean, the kept checkpoints intact; at the end a complete GC
leaves nothing unreferenced, and the kept checkpoints restore.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .store_support import (
    IN_CREATE,
    IN_DELETE,
    IN_MOVED_TO,
    Daemons,
    assert_prefix_continues,
    assert_verify_clean,
    criu_pids,
    finish,
    kill_on,
    kill_pid,
    kill_when,
    largest_pack,
    leftovers,
    manifest_refs,
    staging_dirs,
    store_files,
    tracer_of,
    wait_criu_gone,
)
from .support import (
    Daemon,
    LineReader,
    Procs,
    assert_continues_from_dump_point,
    assert_continuity,
    assert_ok,
    assert_running,
    assert_same_lines,
    free_pid,
    is_alive,
    proc_state,
    reference,
    wait_for_done,
    wait_for_lines,
    wait_until,
    with_interval,
    workload,
)

pytestmark = pytest.mark.integration

RANDOM_ITERATIONS = 8
TIME_BUDGET_S = 75.0
"""Random iterations stop early once the loop has run this long (the chosen ones still run)."""
MAX_DELAY_S = 1.5
"""At least this; more when an undisturbed dump takes longer here (``_dump_time``): the random
kills must span the whole dump, its commit included, whatever the machine's speed."""
MIB = 256
REF_STEPS = 300
INTERVAL = 50
POST_LINES = 8


def crash_seed() -> int:
    env = os.environ.get("CKPTD_CRASH_SEED", "")
    seed = int(env) if env else random.SystemRandom().randrange(1 << 32)
    print(f"\ncrash test seed {seed} (CKPTD_CRASH_SEED={seed} replays it)")
    return seed


@pytest.fixture
def daemons(tmp_path: Path, workloads: Path) -> Iterator[Daemons]:
    del workloads
    ds = Daemons(tmp_path)
    try:
        yield ds
    finally:
        ds.close()


class Job:
    """A workload whose stdout is a pipe we read (a restore gives it an output file)."""

    def __init__(self, procs: Procs, cmd: list[str], interval_ms: int = INTERVAL) -> None:
        self.proc = procs.popen(
            with_interval(cmd, interval_ms), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout.fileno())
        self.pid = self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def traced(pid: int) -> bool:
    return tracer_of(pid) != 0


def finished(proc: subprocess.Popen[str]) -> bool:
    return proc.poll() is not None


def restore(d: Daemon, procs: Procs, ck_id: str) -> tuple[int, Path]:
    res = assert_ok(d.ctl("restore", ck_id), f"restore {ck_id}")
    procs.add(res["pid"])
    assert res["id"] == ck_id
    assert res["output_path"], "stdout was a pipe: the restore must name its output file"
    return res["pid"], Path(res["output_path"])


# ---- dumps --------------------------------------------------------------------------------------


def _dump_time(ds: Daemons, procs: Procs, cmd: list[str]) -> float:
    """Wall time of one undisturbed killing dump of ``cmd``'s job (then deleted): the longer
    of the two kinds, its commit and kill included."""
    d = ds.start()
    job = Job(procs, cmd)
    job.reader.read_lines(3, timeout=30)
    started = time.monotonic()
    ck = assert_ok(d.ctl("dump", job.pid), "calibration dump")
    took = time.monotonic() - started
    job.kill()
    assert_ok(d.ctl("delete", ck["id"]), "delete")
    Daemons.stop(d)
    return took


def _trigger(kind: str, ds: Daemons, pid: int) -> tuple[list[tuple[Path, int]], Any]:
    """What to watch, and which event kills the daemon, for a chosen crash point."""
    if kind == "after-criu":
        # Once CRIU is done the journal is rewritten with the pids it froze; the job (dumped
        # without --leave-running) is stopped then, no longer traced: state T, not t.
        return (
            [(ds.state_dir / "journal", IN_MOVED_TO)],
            lambda _d, name, _m: name.endswith(".json") and proc_state(pid) == "T",
        )
    assert kind == "after-manifest"
    (ds.store / "manifests").mkdir(parents=True, exist_ok=True, mode=0o700)
    return (
        [(ds.store / "manifests", IN_CREATE | IN_MOVED_TO)],
        lambda _d, name, _m: name.startswith("ck-"),
    )


def test_daemon_killed_during_dumps_recovers(
    daemons: Daemons, procs: Procs
) -> None:
    ds = daemons
    seed = crash_seed()
    rng = random.Random(seed)
    cmd = workload("bigmem", "--mib", MIB, "--rewrite-pct", 1, "--steps", 0)
    ref = reference(with_interval(
        workload("bigmem", "--mib", MIB, "--rewrite-pct", 1, "--steps", REF_STEPS), 0
    ))
    max_delay = max(MAX_DELAY_S, 1.5 * _dump_time(ds, procs, cmd))
    print(f"random kills within {max_delay:.2f}s")
    plan: list[tuple[str, bool]] = [("random", i % 2 == 1) for i in range(RANDOM_ITERATIONS)]
    plan += [("during-criu", False), ("after-criu", False), ("after-manifest", False)]
    known: set[str] = set()
    restores = 0
    started = time.monotonic()
    for i, (kind, leave) in enumerate(plan):
        if kind == "random" and time.monotonic() - started > TIME_BUDGET_S:
            print(f"#{i}: skipped (time budget)")
            continue
        where = f"[seed {seed}, iteration {i}, {kind}, leave_running={leave}]"
        print(f"#{i} {kind} leave={leave} ...")  # shown with the failure, if any
        d1 = ds.start()
        job = Job(procs, cmd)
        job.reader.read_lines(3 + rng.randrange(8), timeout=30)
        low = len(job.reader.drain())
        ctl = d1.popen("dump", job.pid, *(["--leave-running"] if leave else []))
        if kind == "random":
            delay = rng.uniform(0.0, max_delay)
            time.sleep(delay)
            Daemons.kill9(d1)
            how = f"after {delay:.3f}s"
        elif kind == "during-criu":  # CRIU has seized the tree (ptrace)
            fired = kill_when(d1, functools.partial(traced, job.pid), timeout=30,
                              also_stop=functools.partial(finished, ctl))
            how = "while CRIU traces the tree" if fired else "after the dump (missed CRIU)"
        else:
            watches, hit = _trigger(kind, ds, job.pid)
            fired = kill_on(d1, watches, hit, timeout=30,
                            also_stop=functools.partial(finished, ctl))
            how = "at the event" if fired else "after the dump (event missed)"
        rc, out, _err = finish(ctl)
        state_at_kill = proc_state(job.pid)
        in_flight = sorted(p.name for p in (ds.state_dir / "journal").glob("*.json"))
        leases = len(store_files(ds.store, "leases"))
        criu_left = bool(criu_pids(ds.state_dir))

        d2 = ds.start()  # recovers; CRIU may still be running: it waits for it
        wait_criu_gone(ds.state_dir)
        listed = assert_ok(d2.ctl("list"), "list")
        ids = [c["id"] for c in listed]
        mine = [c for c in listed if c["pid"] == job.pid and c["id"] not in known]
        assert len(mine) <= 1, f"{where} one dump, several checkpoints: {mine}"
        if rc == 0:
            reported = json.loads(out)["id"]
            assert [c["id"] for c in mine] == [reported], (
                f"{where} ckptctl reported {reported} done, the restarted daemon lists {ids}"
            )
        committed = bool(mine)

        pre: list[str] = []
        if committed and not leave:
            wait_until(lambda pid=job.pid: not is_alive(pid), 10, f"{where} the job killed")
            pre = job.reader.read_to_eof()
            job.kill()
            assert low <= len(pre), f"{where} {len(pre)} lines before the dump, {low} seen"
            assert_same_lines(pre, ref[: len(pre)], f"{where} the job before its dump")
        else:
            assert_running(job.pid, f"{where} (its dump was not committed or left it running)")
            seen = len(job.reader.drain())
            job.reader.read_lines(seen + 2, timeout=5)  # it makes progress
            assert_running(job.pid, f"{where} (after the restart)")

        assert not leftovers(ds.store, ds.state_dir), f"{where} {leftovers(ds.store, ds.state_dir)}"
        assert_verify_clean(d2, ids)

        if committed:
            ck = mine[0]
            if leave:
                high = len(job.reader.drain())
                job.kill()
                pid, output = restore(d2, procs, ck["id"])
                post = wait_for_lines(output, POST_LINES, timeout=15)[:POST_LINES]
                assert_prefix_continues(post, ref, low, high)
            else:
                pid, output = restore(d2, procs, ck["id"])
                post = wait_for_lines(output, POST_LINES, timeout=15)[:POST_LINES]
                assert_same_lines(pre + post, ref[: len(pre) + POST_LINES],
                                  f"{where} before the dump + restored")
            assert pid == job.pid
            kill_pid(pid)
            restores += 1
        else:
            job.kill()

        # Keep the store small (verify reads every checkpoint), not its packs: later dumps
        # deduplicate against what earlier ones, crashed or not, have written.
        for old in ids[:-2]:
            assert_ok(d2.ctl("delete", old), "delete")
        known.update(ids)
        Daemons.stop(d2)
        print(
            f"#{i} {kind:14s} leave={leave!s:5s} killed {how}: ckptctl rc {rc}, job state "
            f"{state_at_kill}, CRIU left {criu_left}, journal {len(in_flight)}, lease {leases}, "
            f"committed {committed}"
        )
    assert restores >= 1, "no iteration committed a checkpoint to restore"


# ---- garbage collection -------------------------------------------------------------------------


def dump_job(
    d: Daemon, procs: Procs, cmd: list[str], *args: object, interval_ms: int = INTERVAL
) -> tuple[dict[str, Any], Job, int, int]:
    """Start ``cmd``, dump it after 3 lines: (checkpoint, job, lines before, lines after)."""
    job = Job(procs, cmd, interval_ms)
    job.reader.read_lines(3, timeout=30)
    low = len(job.reader.drain())
    ck = assert_ok(d.ctl("dump", job.pid, *args), "dump")
    high = len(job.reader.drain())
    return ck, job, low, high


def referenced(store: Path) -> tuple[set[str], set[str]]:
    """Packs and blobs the manifests on disk name."""
    packs: set[str] = set()
    blobs: set[str] = set()
    for path in store_files(store, "manifests"):
        more_packs, more_blobs = manifest_refs(store, path.name)
        packs |= more_packs
        blobs |= more_blobs
    return packs, blobs


def gc_at_once(ds: Daemons) -> list[str]:
    """Flags for a daemon whose GC deletes unreferenced data at once (``gc_grace_s`` 0):
    what GC deletes is checked here, two-phase GC itself in tests/unit/store. The test's
    ``ckptctl gc`` is the only GC (``gc_interval_s`` 0: the daemon's own, after ``--keep``
    deletes, would run beside the one the test kills)."""
    conf = ds.root / "gc-at-once.toml"
    conf.write_text("gc_grace_s = 0.0\ngc_interval_s = 0.0\n")
    return ["--config", str(conf)]


def test_daemon_killed_during_gc_recovers(daemons: Daemons, procs: Procs) -> None:
    ds = daemons
    seed = crash_seed()
    rng = random.Random(seed)
    steps, interval = 30, 30
    big = workload("bigmem", "--mib", 64, "--rewrite-pct", 1, "--steps", steps)
    small = workload("counter", "--mem-mib", 8, "--steps", steps)
    ref_big = reference(with_interval(big, 0))
    ref_small = reference(with_interval(small, 0))

    d = ds.start(*gc_at_once(ds))
    keep1, job1, _, _ = dump_job(d, procs, big, "--name", "keep", interval_ms=interval)
    pre1 = job1.reader.read_to_eof()
    job1.kill()
    keep2, job2, low2, high2 = dump_job(d, procs, small, "--leave-running",
                                        interval_ms=interval)
    job2.kill()
    keepers = [keep1["id"], keep2["id"]]

    for rnd in range(3):
        where = f"[seed {seed}, round {rnd}]"
        junk = []
        for _ in range(3):
            ck, job, _, _ = dump_job(d, procs, workload("counter", "--mem-mib", 4, "--steps", 0),
                                     "--name", "junk")
            job.kill()
            junk.append(ck["id"])
        assert_ok(d.ctl("delete", junk[0]), "delete")  # garbage; junk[1] goes by retention

        watches = [(ds.store / "manifests", IN_DELETE)]
        watches += [(p, IN_DELETE) for sub in ("packs", "blobs")
                    for p in sorted((ds.store / sub).iterdir()) if p.is_dir()]
        k = rng.randint(1, 12)
        deleted: list[str] = []

        def kth_deletion(directory: Path, name: str, _mask: int, k: int = k,
                         deleted: list[str] = deleted) -> bool:
            if not name.startswith(".tmp."):
                deleted.append(f"{directory.name}/{name}")
            return len(deleted) >= k

        ctl = d.popen("gc", "--keep-last", 1, "--name", "junk")
        fired = kill_on(d, watches, kth_deletion, timeout=30,
                        also_stop=functools.partial(finished, ctl))
        rc, _, _ = finish(ctl)
        print(f"{where} gc killed after {len(deleted)} deletion(s) (k={k}, fired={fired}), "
              f"ckptctl gc rc {rc}")

        d = ds.start(*gc_at_once(ds))
        ids = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
        assert set(keepers) <= set(ids), f"{where} a kept checkpoint is gone: {ids}"
        assert junk[0] not in ids, f"{where} a deleted checkpoint came back"
        assert junk[2] in ids, f"{where} retention deleted the newest junk checkpoint"
        if rc == 0:
            assert junk[1] not in ids, f"{where} gc reported done, retention not applied"
        assert_verify_clean(d, ids)
        assert not leftovers(ds.store, ds.state_dir), f"{where} {leftovers(ds.store, ds.state_dir)}"

    # A complete GC now leaves nothing that no checkpoint needs, and nothing needed is gone.
    assert_ok(d.ctl("gc", "--keep-last", 1, "--name", "junk"), "gc")
    ids = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
    assert len([i for i in ids if i not in keepers]) == 1, ids
    packs, blobs = referenced(ds.store)
    on_disk_packs = {p.name for p in store_files(ds.store, "packs")}
    on_disk_blobs = {p.name for p in store_files(ds.store, "blobs")}
    assert on_disk_packs == packs, (
        f"packs no checkpoint names: {on_disk_packs - packs}; missing: {packs - on_disk_packs}"
    )
    assert on_disk_blobs == blobs, (
        f"blobs no checkpoint names: {on_disk_blobs - blobs}; missing: {blobs - on_disk_blobs}"
    )
    assert_verify_clean(d, ids)

    pid, output = restore(d, procs, keep1["id"])
    assert_continuity(pre1, wait_for_done(output, timeout=30), ref_big)
    kill_pid(pid)
    pid, output = restore(d, procs, keep2["id"])
    assert_continues_from_dump_point(wait_for_done(output, timeout=30), ref_small, low2, high2)
    kill_pid(pid)
    Daemons.stop(d)


def test_daemon_killed_during_compaction_recovers(daemons: Daemons, procs: Procs) -> None:
    """GC compacting (issue 24, point 4: packs a few live pages pin are rewritten, the
    manifests that named them rewritten, the old packs deleted), SIGKILLed at a random one of
    its writes or deletions. The next daemon: every kept checkpoint listed and verifying, no
    compaction lease left; a complete GC then leaves only what the manifests name, the first
    (full) pack freed, and the newest checkpoint restores and goes on line for line."""
    ds = daemons
    seed = crash_seed()
    rng = random.Random(seed)
    cmd = workload("bigmem", "--mib", 16, "--rewrite-pct", 10, "--steps", 800)
    ref = reference(with_interval(cmd, 0))
    d = ds.start(*gc_at_once(ds))
    job = Job(procs, cmd, 20)
    job.reader.read_lines(2, timeout=30)
    low = high = 0
    for _ in range(5):
        job.reader.read_lines(len(job.reader.lines) + 3, timeout=30)
        low = len(job.reader.drain())
        ck = assert_ok(d.ctl("dump", job.pid, "--leave-running", "--name", "churn",
                             "--keep", 2), "dump --leave-running")
        high = len(job.reader.drain())
    job.kill()
    newest = ck["id"]
    kept = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
    assert len(kept) == 2 and kept[-1] == newest, kept
    first_pack = largest_pack(ds.store)

    for rnd in range(2):
        where = f"[seed {seed}, round {rnd}]"
        watches = [(ds.store / sub, IN_CREATE | IN_MOVED_TO | IN_DELETE)
                   for sub in ("packs", "manifests", "leases")]
        watches += [(p, IN_MOVED_TO | IN_DELETE) for p in sorted((ds.store / "packs").iterdir())
                    if p.is_dir()]
        k = rng.randint(1, 6)
        seen: list[str] = []

        def kth_event(directory: Path, name: str, _mask: int, k: int = k,
                      seen: list[str] = seen) -> bool:
            if not name.startswith(".tmp."):
                seen.append(f"{directory.name}/{name}")
            return len(seen) >= k

        ctl = d.popen("gc")
        fired = kill_on(d, watches, kth_event, timeout=30,
                        also_stop=functools.partial(finished, ctl))
        rc, _, _ = finish(ctl)
        print(f"{where} gc killed after {seen} (k={k}, fired={fired}), ckptctl gc rc {rc}")
        d = ds.start(*gc_at_once(ds))
        ids = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
        assert ids == kept, f"{where} listed {ids}, expected {kept}"
        assert_verify_clean(d, kept)
        assert not leftovers(ds.store, ds.state_dir), f"{where} {leftovers(ds.store, ds.state_dir)}"

    report = assert_ok(d.ctl("gc"), "gc")
    packs, _blobs = referenced(ds.store)
    on_disk = {p.name for p in store_files(ds.store, "packs")}
    assert on_disk == packs, f"unreferenced: {on_disk - packs}; missing: {packs - on_disk}"
    assert not first_pack.exists(), f"the first checkpoint's pack is still pinned: {report}"
    assert_verify_clean(d, kept)
    pid, output = restore(d, procs, newest)
    assert_continues_from_dump_point(wait_for_done(output, timeout=90), ref, low, high)
    kill_pid(pid)
    Daemons.stop(d)


# ---- what a crash leaves on disk ----------------------------------------------------------------


def test_start_up_removes_what_a_crash_left(daemons: Daemons, procs: Procs) -> None:
    """The files a daemon killed at the worst moments leaves, planted by hand (the random
    kills above hit these windows only rarely): a half-written object, a half-written journal
    record, a dump in flight (journal record, lease, staging), a restore's checkout. The next
    daemon removes them all, lists nothing partial, and leaves another node's lease alone."""
    ds = daemons
    d = ds.start()
    ck, job, _, _ = dump_job(d, procs, workload("counter", "--mem-mib", 2, "--steps", 0))
    job.kill()
    Daemons.kill9(d)

    crashed = "ck-20200101T000000-c0ffee"
    foreign = "ck-20200101T000001-f0e1d2"
    gone_pid = free_pid()
    staging, fast = staging_dirs(ds.state_dir)
    planted = [
        ds.store / "packs" / "ab" / ".tmp.0123456789ab",
        ds.store / "manifests" / ".tmp.ba9876543210",
        ds.state_dir / "journal" / f".{crashed}.json.tmp.4242",
        ds.store / "leases" / crashed,
        staging / crashed / "images" / "pages-1.img",
        fast / f"restore-{ck['id']}-abcdef" / "images" / "core-1.img",
    ]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    (ds.state_dir / "journal" / f"{crashed}.json").write_text(json.dumps({
        "op": "dump", "checkpoint_id": crashed, "pids": [gone_pid], "stopped_before": [],
        "leave_running": False,
    }))
    (ds.store / "leases" / foreign).write_text(json.dumps({"node": "elsewhere"}))

    d = ds.start()
    left = leftovers(ds.store, ds.state_dir)
    assert left == [f"lease left: {ds.store / 'leases' / foreign}"], left
    assert "rolled back dump " + crashed in d.log()
    ids = [c["id"] for c in assert_ok(d.ctl("list"), "list")]
    assert ids == [ck["id"]]
    assert_verify_clean(d, ids)
    Daemons.stop(d)
