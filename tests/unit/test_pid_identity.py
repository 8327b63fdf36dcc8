"""Signals reach only the processes identified (held by handle, start time checked), never a
process that took a pid later, and never the node's process at a pid that CRIU's images use
inside a job's own pid namespace. Over the fakes."""

from __future__ import annotations

import signal

import pytest

from ckptd.core.dump import DumpContext
from ckptd.core.recipe import record_undo
from ckptd.core.undo import ResumeTree, decode_entry
from ckptd.domain import DumpRequest, PidState
from ckptd.domain.model import ROOT
from ckptd.errors import TargetRefused

from .world import JOB, OTHER_JOB, World

SIGKILL, SIGCONT = int(signal.SIGKILL), int(signal.SIGCONT)
NS_JOB = 4000
NS_TREE = (4000, 4001, 4002)
INNER = (1, 5, 6)
"""The job's pids inside its namespace; node pids 5 and 6 hold decoys (pid 1 is init)."""
DECOYS = (5, 6)
PID_NS = frozenset({"pid"})


def _crash_after(world: World, step: str, request: DumpRequest) -> DumpContext:
    ctx = world.dump_recipe.new_context(ROOT, request)
    for s in world.dump_recipe.steps:
        record_undo(s, ctx, ctx.undo_log)  # as run_steps does: the undo durable first
        s.do(ctx)
        if s.name == step:
            assert ctx.held is not None
            ctx.held.close()  # the daemon dies: its pidfds go with it
            return ctx
    raise AssertionError(f"no step {step}")


def _replace(world: World, pid: int, state: PidState = PidState.STOPPED) -> None:
    """The process at ``pid`` ends and is reaped; a newcomer (another start time) takes
    the pid, in ``state`` (stopped: the state a dumped process would be in)."""
    world.processes.remove(pid)
    world.processes.add_process(pid, 1, comm="newcomer", state=state)


@pytest.fixture
def ns_world(world: World) -> World:
    for decoy in DECOYS:
        world.processes.add_process(decoy, 1, comm="decoy")
    world.processes.add_process(NS_JOB, 1, comm="nsinit", ns_pid=1, namespaces=PID_NS)
    for pid, inner in zip(NS_TREE[1:], INNER[1:], strict=True):
        world.processes.add_process(pid, NS_JOB, comm="nskid", ns_pid=inner, namespaces=PID_NS)
    return world


def _signalled(world: World, *pids: int) -> list[tuple[int, int]]:
    return [(p, s) for p, s in world.processes.signals if p in pids]


# ---- pid reuse ---------------------------------------------------------------------------


def test_a_pid_reused_during_the_dump_is_not_killed_with_the_tree(world: World) -> None:
    """Between identification and the kill, the tree's 1002 ends and a newcomer takes its
    pid: the kill reaches the tree, not the newcomer."""
    world.hooks.on["post_dump"] = lambda _pid: _replace(world, 1002, PidState.RUNNING)
    world.dump(JOB)
    assert world.processes.state(1002) is PidState.RUNNING
    assert world.processes.processes[1002].comm == "newcomer"
    assert world.processes.signals_to(1002) == []
    assert world.processes.signals_to(1000) == [SIGKILL]


def test_a_failed_dump_does_not_resume_a_stopped_newcomer(world: World) -> None:
    from ckptd.errors import CriuFailed

    world.hooks.on["post_dump"] = lambda _pid: _replace(world, 1001)
    world.criu.fail_dump = CriuFailed("CRIU dump failed: boom")
    world.criu.fail_dump_after = "post_dump"
    with pytest.raises(CriuFailed):
        world.dump(JOB)
    assert world.processes.signals_to(1001) == []
    assert world.states(1000, 1002) == ["running", "running"]


@pytest.mark.parametrize("step", ["criu-dump", "commit"])
def test_recovery_never_signals_a_newcomer_at_a_journaled_pid(world: World, step: str) -> None:
    """The daemon dies with the tree frozen (rolled back at restart) or committed (killed at
    restart); meanwhile 1001 ended and a stopped newcomer took its pid: untouched."""
    _crash_after(world, step, DumpRequest(JOB))
    _replace(world, 1001)
    world.processes.signals.clear()
    world.new_service().recover()
    assert world.processes.signals_to(1001) == []
    assert world.processes.state(1001) is PidState.STOPPED
    want = SIGCONT if step == "criu-dump" else SIGKILL
    assert world.processes.signals_to(1000) == [want]
    assert world.processes.signals_to(1002) == [want]


def test_every_handle_is_closed_after_a_dump(world: World) -> None:
    world.dump(JOB)
    world.dump(OTHER_JOB, leave_running=True)
    assert world.processes.handles and all(h.closed for h in world.processes.handles)


# ---- the init of a pid namespace of its own ---------------------------------------------


def test_a_pid_namespace_job_is_killed_by_its_node_pids_never_its_inner_pids(
    ns_world: World,
) -> None:
    record = ns_world.dump(NS_JOB)
    assert ns_world.criu.dump_jobs[0].pid == NS_JOB
    assert [(p.pid, p.image_pid) for p in record.processes] == list(
        zip(NS_TREE, INNER, strict=True))
    assert record.own_pid_namespace
    assert [p for p, s in ns_world.processes.signals if s == SIGKILL] == list(NS_TREE)
    assert _signalled(ns_world, 1, *DECOYS) == []
    assert ns_world.states(*DECOYS) == ["running", "running"]


def test_a_failed_pid_namespace_dump_resumes_the_tree_not_the_decoys(ns_world: World) -> None:
    from ckptd.errors import CriuFailed

    for decoy in DECOYS:
        ns_world.processes.processes[decoy].state = PidState.STOPPED  # worst case
    ns_world.criu.fail_dump = CriuFailed("CRIU dump failed: boom")
    ns_world.criu.fail_dump_after = "post_dump"
    with pytest.raises(CriuFailed):
        ns_world.dump(NS_JOB)
    assert _signalled(ns_world, 1, *DECOYS) == []
    assert ns_world.states(*NS_TREE) == ["running"] * 3


def test_restore_of_a_pid_namespace_job_needs_no_free_pids_and_holds_the_new_ones(
    ns_world: World,
) -> None:
    record = ns_world.dump(NS_JOB)
    ns_world.processes.add_process(NS_JOB, 1, comm="unrelated")  # its old node pid is taken
    outcome = ns_world.restore(checkpoint_id=record.id)
    assert outcome.pid not in (NS_JOB, *INNER)
    restored = ns_world.processes.tree(outcome.pid)
    assert [p.image_pid for p in restored] == list(INNER)
    assert ns_world.processes.state(NS_JOB) is PidState.RUNNING
    assert ns_world.processes.processes[NS_JOB].comm == "unrelated"


def test_a_gated_restore_of_a_pid_namespace_job_resumes_its_new_pids(ns_world: World) -> None:
    record = ns_world.dump(NS_JOB)
    seen: list[int] = []
    from ckptd.domain import RestoreRequest

    outcome = ns_world.service.restore(ROOT, RestoreRequest(checkpoint_id=record.id),
                                       gate=seen.append)
    new = [p.pid for p in ns_world.processes.tree(outcome.pid)]
    assert seen == [outcome.pid]
    assert [p for p, s in ns_world.processes.signals if s == SIGCONT] == new
    assert ns_world.states(*new) == ["running"] * 3
    assert _signalled(ns_world, 1, *DECOYS) == []


# ---- refused before anything is touched ------------------------------------------------


def _assert_refused(world: World, pid: int, *needles: str) -> None:
    with pytest.raises(TargetRefused) as info:
        world.dump(pid)
    for needle in needles:
        assert needle in str(info.value)
    assert world.criu.dump_jobs == []
    assert world.processes.signals == []
    assert world.journal.history == []


def test_a_process_inside_a_namespace_that_is_not_its_init_is_refused(ns_world: World) -> None:
    _assert_refused(ns_world, 4001, "is pid 5 inside a pid namespace", "not that namespace's init")


def test_a_tree_with_a_nested_pid_namespace_is_refused(world: World) -> None:
    world.processes.add_process(5000, 1, comm="unshare")
    world.processes.add_process(5001, 5000, comm="nsinit", ns_pid=1, namespaces=PID_NS)
    _assert_refused(world, 5000, "process 5001 (nsinit)", "nested")


@pytest.mark.parametrize(("kind", "needle"), [("mnt", "mount namespace"),
                                              ("user", "user namespace"),
                                              ("net", "network namespace")])
def test_a_namespace_kind_not_handled_yet_is_refused(
    world: World, kind: str, needle: str
) -> None:
    world.processes.add_process(5000, 1, comm="boxed", ns_pid=1,
                                namespaces=frozenset({"pid", kind}))
    _assert_refused(world, 5000, needle)


def test_a_job_in_its_own_uts_ipc_cgroup_and_time_namespaces_is_dumped(world: World) -> None:
    world.processes.add_process(5000, 1, comm="boxed", ns_pid=1,
                                namespaces=frozenset({"pid", "uts", "ipc", "cgroup", "time"}))
    assert world.dump(5000).own_pid_namespace


def test_journal_of_a_dump_names_node_pids_with_start_times(ns_world: World) -> None:
    ctx = _crash_after(ns_world, "criu-dump", DumpRequest(NS_JOB))
    (facts,) = [f for _op, f in ns_world.journal.pending()]
    starts = [ns_world.processes.processes[p].start_time for p in NS_TREE]
    entry = decode_entry(facts)
    (resume,) = [u for u in entry.undos if isinstance(u, ResumeTree)]
    assert resume.members == tuple(zip(NS_TREE, starts, strict=True))
    assert entry.checkpoint_id == ctx.checkpoint_id
