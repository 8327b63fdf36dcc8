"""PolicyService over fakes: periodic checkpoints, retention passed on, persistence across a
restart, owners, drain / resume / spot notice, failures recorded and never raised by tick."""

from __future__ import annotations

import pytest

from ckptd.core.events import EventBus
from ckptd.core.policies import PolicyService
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    DumpRequest,
    EventKind,
    Policy,
    RestoreOutcome,
    RestoreRequest,
    parse_duration,
)
from ckptd.domain.model import ROOT
from ckptd.errors import (
    CheckpointNotFound,
    CriuFailed,
    InvalidTarget,
    PermissionDenied,
    PreconditionFailed,
)
from ckptd.testing import FakeClock, FakeProcessTable, MemoryPolicyRepo

USER = Caller(uid=1000)
OTHER = Caller(uid=2000)


class Node:
    def __init__(self, repo: MemoryPolicyRepo | None = None) -> None:
        self.clock = FakeClock()
        self.processes = FakeProcessTable()
        self.processes.add_process(500, 1, comm="train", uid=1000)
        self.processes.add_process(600, 1, comm="serve", uid=1000)
        self.processes.add_process(700, 1, comm="other", uid=2000)
        self.dumps: list[tuple[Caller, DumpRequest]] = []
        self.restores: list[RestoreRequest] = []
        self.fail: set[int] = set()
        self.during_dump: list[Exception] = []
        self.on_dump: object = None
        self.repo = repo or MemoryPolicyRepo()
        self.bus = EventBus(self.clock)
        self.events = self.bus.subscribe()
        self.policies = PolicyService(
            dump=self.dump, restore=self.restore, repo=self.repo, processes=self.processes,
            clock=self.clock, events=self.bus,
        )

    def dump(self, caller: Caller, request: DumpRequest) -> CheckpointRecord:
        if callable(self.on_dump):
            try:
                self.on_dump()
            except Exception as exc:
                self.during_dump.append(exc)
        if request.pid in self.fail:
            raise CriuFailed(f"CRIU dump of pid {request.pid} failed")
        self.dumps.append((caller, request))
        if not request.leave_running:
            self.processes.remove(request.pid)
        return CheckpointRecord(id=f"ck-{len(self.dumps)}", pid=request.pid,
                                created=self.clock.time(), node="n", uid=caller.uid,
                                name=request.name, bytes_new=10)

    def restore(self, caller: Caller, request: RestoreRequest) -> RestoreOutcome:
        self.restores.append(request)
        if not self.processes.status(500).uid:  # the restored process runs (a new start)
            self.processes.add_process(500, 1, comm="train", uid=1000)
        return RestoreOutcome(request.checkpoint_id, 500, "", 0.1)

    def kinds(self) -> list[EventKind]:
        out = []
        while (e := self.events.next(0)) is not None:
            out.append(e.kind)
        return out


def test_periodic_checkpoints_fire_when_due_as_the_owner_with_retention() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=900, keep=3))
    assert n.policies.tick() == ["train"], "never fired: due at once"
    n.clock.advance(899)
    assert n.policies.tick() == []
    n.clock.advance(1)
    assert n.policies.tick() == ["train"]
    assert [(c.uid, r.pid, r.leave_running, r.name, r.keep) for c, r in n.dumps] == [
        (1000, 500, True, "train", 3)] * 2
    p = n.policies.get(USER, "train")
    assert p.last_checkpoint_id == "ck-2" and p.last_error == ""
    assert EventKind.POLICY_FIRED in n.kinds()


def test_a_failed_periodic_checkpoint_is_recorded_and_retried_next_period() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60))
    n.fail.add(500)
    assert n.policies.tick() == ["train"]
    assert "CRIU dump of pid 500 failed" in n.policies.get(USER, "train").last_error
    n.fail.clear()
    n.clock.advance(30)
    assert n.policies.tick() == []
    n.clock.advance(30)
    n.policies.tick()
    assert n.policies.get(USER, "train").last_error == ""


def test_policies_survive_a_restart() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    again = Node(MemoryPolicyRepo(n.repo.saved))
    assert again.policies.list(USER) == n.policies.list(USER)


def test_users_see_and_change_only_their_own() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60))
    # a name is its owner's (issue 21): OTHER's "train" is its own job, USER's is untouched
    n.policies.set(OTHER, Policy(name="train", pid=700, every_s=60))
    assert [(p.uid, p.pid) for p in n.policies.list(USER)] == [(1000, 500)]
    with pytest.raises(PermissionDenied):
        n.policies.set(USER, Policy(name="theirs", pid=700))
    n.policies.clear(OTHER, "train")
    with pytest.raises(CheckpointNotFound):
        n.policies.clear(OTHER, "train")  # USER's "train" is never OTHER's to clear
    assert n.policies.list(OTHER) == []
    assert [p.uid for p in n.policies.list(ROOT)] == [1000]


@pytest.mark.parametrize("policy", [
    Policy(name="bad name!", pid=500), Policy(name="fast", pid=500, every_s=1),
    Policy(name="gone", pid=4242), Policy(name="neg", keep=-1),
])
def test_bad_policies_are_refused(policy: Policy) -> None:
    with pytest.raises(InvalidTarget):
        Node().policies.set(ROOT, policy)


def test_drain_checkpoints_every_protected_job_and_resume_brings_them_back() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    n.policies.set(USER, Policy(name="serve", pid=600, on_term=True))
    n.policies.set(ROOT, Policy(name="periodic-only", pid=700, every_s=60))
    n.fail.add(600)
    drained, errors = n.policies.drain(ROOT)
    assert [p.name for p in drained] == ["train"]
    assert len(errors) == 1 and errors[0].startswith("serve (pid 600)")
    assert {r.pid for _c, r in n.dumps} == {500}
    assert all(not r.leave_running for _c, r in n.dumps)
    assert n.policies.get(USER, "train").drained_checkpoint_id == "ck-1"
    assert n.policies.tick() == ["periodic-only"], "a drained job is not checkpointed again"

    restored, errors = n.policies.resume(USER)
    assert [r.checkpoint_id for r in restored] == ["ck-1"] and errors == []
    assert n.policies.get(USER, "train").drained_checkpoint_id == ""
    with pytest.raises(PreconditionFailed, match="still runs as pid 500"):
        n.policies.resume(USER, "train")  # never twice: the resumed job runs
    kinds = n.kinds()
    assert EventKind.DRAIN in kinds and EventKind.RESUME in kinds


def test_only_root_drains_the_node_but_a_user_drains_their_job() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    with pytest.raises(PermissionDenied):
        n.policies.drain(USER)
    drained, _ = n.policies.drain(USER, names=["train"])
    assert [p.name for p in drained] == ["train"]


def test_a_spot_notice_drains_and_says_so() -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    drained, _ = n.policies.spot_notice("aws", "terminate at 12:00")
    assert [p.name for p in drained] == ["train"]
    assert n.kinds()[-2:] == [EventKind.SPOT_NOTICE, EventKind.DRAIN]


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("30s", 30), ("15m", 900), ("2h", 7200), ("1d", 86400), ("500ms", 0.5)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_bad_duration() -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration("15 minutes")


def test_the_callers_only_child_is_the_job_whatever_pids_the_caller_sees() -> None:
    """``ckptctl run`` in a container: its pids are not the daemon's; SO_PEERCRED's are."""
    n = Node()
    n.processes.add_process(800, 1, comm="ckptctl", uid=1000)
    n.processes.add_process(801, 800, comm="train", uid=1000)
    launcher = Caller(uid=1000, pid=800)
    policy = n.policies.set(launcher, Policy(name="in-pod", on_term=True), callers_child=True)
    assert policy.pid == 801
    n.processes.add_process(802, 800, comm="extra", uid=1000)
    with pytest.raises(InvalidTarget, match="has 2 child processes"):
        n.policies.set(launcher, Policy(name="two", on_term=True), callers_child=True)
    with pytest.raises(InvalidTarget, match="caller's process is unknown"):
        n.policies.set(USER, Policy(name="nopid"), callers_child=True)


def test_a_policy_cannot_be_cleared_while_its_job_is_being_checkpointed() -> None:
    """``ckptctl run`` sees its job die as a drain kills it, before the drain recorded it."""
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    n.on_dump = lambda: n.policies.clear(USER, "train")
    drained, _ = n.policies.drain(ROOT)
    assert [p.name for p in drained] == ["train"]
    assert [type(e).__name__ for e in n.during_dump] == ["Busy"]
    assert n.policies.get(USER, "train").drained_checkpoint_id == "ck-1"


def test_clear_unless_drained_keeps_a_drained_job_and_names_its_checkpoint() -> None:
    """``ckptctl run``'s job ended: forget its policy unless a drain took it, in one step. A
    look then a clear would lose a drain that ends between the two (the launcher then said
    137, not 143, and a batch script would not requeue the job)."""
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    n.policies.set(USER, Policy(name="other", pid=600, on_term=True))
    drained, _ = n.policies.drain(USER, ["train"])
    assert [p.name for p in drained] == ["train"]
    assert n.policies.clear(USER, "train", unless_drained=True) == "ck-1"
    assert n.policies.get(USER, "train").drained_checkpoint_id == "ck-1"  # kept: resume
    assert n.policies.clear(USER, "other", unless_drained=True) == ""  # not drained: gone
    assert [p.name for p in n.policies.list(USER)] == ["train"]
    assert n.policies.clear(USER, "train") == ""  # plain clear: forgets even a drained one
    assert n.policies.list(USER) == []


def test_a_second_drain_of_a_job_waits_for_the_first_and_reports_it_drained() -> None:
    """A spot notice and a SIGTERM to `ckptctl run` at once: one checkpoint, both see it."""
    import threading

    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    entered, release = threading.Event(), threading.Event()

    def slow() -> None:
        entered.set()
        release.wait(10)

    n.on_dump = slow
    results: list[tuple[list[Policy], list[str]]] = []
    first = threading.Thread(target=lambda: results.append(n.policies.drain(ROOT)))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=lambda: results.append(
        n.policies.drain(USER, names=["train"])))
    second.start()
    with pytest.raises(Exception, match="being checkpointed"):
        n.policies.clear(USER, "train")
    release.set()
    first.join(10)
    second.join(10)
    assert len(n.dumps) == 1, "one checkpoint for both"
    assert [[p.drained_checkpoint_id for p in d] for d, _e in results] == [["ck-1"], ["ck-1"]]
    assert all(e == [] for _d, e in results)


def test_a_reused_pid_is_never_checkpointed_for_the_job() -> None:
    """After the job ended (or the node rebooted) its pid may belong to anything."""
    n = Node()
    n.processes.remove(500)
    n.processes.add_process(500, 1, comm="train", uid=1000, start_time=111)
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    assert n.policies.get(USER, "train").started == 111
    n.processes.remove(500)
    n.processes.add_process(500, 1, comm="journald", uid=1000, start_time=999)
    assert n.policies.tick() == []
    assert n.policies.drain(ROOT) == ([], [])
    assert n.dumps == []
    p = n.policies.get(USER, "train")
    assert p.pid == 0 and "now belongs to another process (journald)" in p.last_error


def test_job_names_are_per_owner() -> None:
    """Issue 21 (9): one user's job named ``train`` never blocks another's (``ckptctl run
    --name train`` sets a policy of that name), nor is drained, resumed or cleared by the
    other; root is asked to act as the owner when owners share the name."""
    node = Node()
    p = node.policies
    p.set(USER, Policy(name="train", pid=500, on_term=True))
    p.set(OTHER, Policy(name="train", pid=700, on_term=True))
    assert [(x.uid, x.pid) for x in p.list(USER)] == [(1000, 500)]
    assert [(x.uid, x.pid) for x in p.list(OTHER)] == [(2000, 700)]
    assert len(p.list(ROOT)) == 2
    with pytest.raises(InvalidTarget, match="jobs named 'train' belong to uids 1000, 2000"):
        p.get(ROOT, "train")
    drained, errors = p.drain(OTHER, ["train"])
    assert [(x.uid, x.pid) for x in drained] == [(2000, 700)] and errors == []
    assert [c.uid for c, _ in node.dumps] == [2000]
    assert not p.get(USER, "train").drained_checkpoint_id
    with pytest.raises(PreconditionFailed, match="'train' still runs as pid 500"):
        p.resume(USER, "train")  # USER's own job, running: the other's drain is not USER's
    p.clear(USER, "train")
    assert p.get(OTHER, "train").drained_checkpoint_id == "ck-1"
    restarted = Node(node.repo)  # persisted by owner and name
    assert [(x.uid, x.name) for x in restarted.policies.list(ROOT)] == [(2000, "train")]


def test_a_restored_job_under_its_old_pid_is_a_new_job_for_its_policy() -> None:
    """CRIU gives a restored job its old pid back: setting the policy again for it (as
    deploy/slurm/train.sbatch does after `ckptctl restore`) must not keep the drain of the
    process before it — only a new start time tells them apart (seen on a real Slurm
    cluster, issue 26: the requeued job took the old drain for a new one)."""
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, on_term=True))
    n.policies.drain(ROOT)
    assert n.policies.get(USER, "train").drained_checkpoint_id == "ck-1"
    n.processes.remove(500)
    n.processes.add_process(500, 1, comm="train", uid=1000)     # restored: a new start time
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    assert n.policies.get(USER, "train").drained_checkpoint_id == ""
    n.policies.set(USER, Policy(name="train", pid=500, every_s=120, on_term=True))
    assert n.policies.get(USER, "train").every_s == 120, "the same process: updated in place"


def test_a_protected_job_that_died_keeps_its_policy_and_resume_restores_its_newest() -> None:
    """Issue 34 (4): the job of ``ckptctl run`` killed by a signal after its policy took
    checkpoints: its policy is kept (not cleared), ``resume NAME`` restores the newest of
    them, once, and only for its owner; a job that still runs is never restored over."""
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    assert n.policies.tick() == ["train"]
    n.clock.advance(60)
    assert n.policies.tick() == ["train"]
    with pytest.raises(PreconditionFailed, match="still runs as pid 500"):
        n.policies.resume(USER, "train")
    assert n.restores == []
    n.processes.remove(500)  # SIGKILLed
    assert n.policies.clear_ended(USER, "train", died=True) == ("", "ck-2")
    assert n.policies.get(USER, "train").last_checkpoint_id == "ck-2"
    assert n.policies.tick() == [], "a dead job is not checkpointed"
    with pytest.raises(CheckpointNotFound):
        n.policies.resume(OTHER, "train")  # names are their owner's
    restored, errors = n.policies.resume(USER, "train")
    assert [r.checkpoint_id for r in restored] == ["ck-2"] and errors == []
    assert [r.checkpoint_id for r in n.restores] == ["ck-2"]
    assert EventKind.RESUME in n.kinds()
    with pytest.raises(PreconditionFailed, match="still runs as pid 500"):
        n.policies.resume(USER, "train")
    assert len(n.restores) == 1, "never resumed twice"
    n.clock.advance(60)
    assert n.policies.tick() == ["train"], "the resumed job is protected again"


def test_a_job_that_ended_on_its_own_or_before_any_checkpoint_leaves_nothing_to_resume(
) -> None:
    n = Node()
    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    n.policies.set(USER, Policy(name="serve", pid=600, every_s=60, on_term=True))
    n.policies.tick()
    n.processes.remove(500)
    n.processes.remove(600)
    assert n.policies.clear_ended(USER, "train", died=False) == ("", "")
    assert [p.name for p in n.policies.list(USER)] == ["serve"]
    with pytest.raises(CheckpointNotFound, match="no protected job named 'train'"):
        n.policies.resume(USER, "train")
    assert n.restores == []


def test_a_died_job_with_no_checkpoint_is_cleared_and_a_resume_under_way_is_held() -> None:
    n = Node()
    n.processes.add_process(800, 1, comm="fresh", uid=1000)
    n.policies.set(USER, Policy(name="fresh", pid=800, on_term=True))
    n.processes.remove(800)
    assert n.policies.clear_ended(USER, "fresh", died=True) == ("", "")
    assert n.policies.list(USER) == []

    n.policies.set(USER, Policy(name="train", pid=500, every_s=60, on_term=True))
    n.policies.tick()
    n.processes.remove(500)
    assert n.policies.clear_ended(USER, "train", died=True) == ("", "ck-1")
    seen: list[Exception] = []
    inner = n.restore

    def restore_racing(caller: Caller, request: RestoreRequest) -> RestoreOutcome:
        try:  # a second resume while the first is restoring
            n.policies.resume(USER, "train")
        except Exception as exc:
            seen.append(exc)
        return inner(caller, request)

    n.policies._restore = restore_racing
    n.policies.resume(USER, "train")
    assert len(n.restores) == 1
    assert len(seen) == 1 and "being checkpointed or resumed already" in str(seen[0])
