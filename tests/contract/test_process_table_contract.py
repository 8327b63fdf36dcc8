"""Contract of ``ProcessTable``: ``ProcFsTable`` on real processes (children of this test) and
``FakeProcessTable`` set up with the same facts. Reading only; no root needed."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from ckptd.domain import PidState, StdioFact, StdioKind
from ckptd.errors import ProcessNotFound

from .harness import ProcessHarness, UringKeep

needs_root_for_real = pytest.mark.usefixtures("root_for_real")


@pytest.fixture
def root_for_real(processes: ProcessHarness) -> None:
    if processes.real and os.geteuid() != 0:
        pytest.skip("needs root on the real table (ns_last_pid, unshare)")


def test_status_of_a_free_pid(processes: ProcessHarness) -> None:
    pid = processes.free_pid()
    status = processes.table.status(pid)
    assert status.pid == pid
    assert status.state is PidState.FREE


@pytest.mark.parametrize("pid", [0, -1])
def test_status_of_an_impossible_pid_is_free(processes: ProcessHarness, pid: int) -> None:
    assert processes.table.status(pid).state is PidState.FREE


def test_status_of_a_running_child(processes: ProcessHarness) -> None:
    pid = processes.spawn()
    status = processes.table.status(pid)
    assert (status.pid, status.state, status.ppid) == (pid, PidState.RUNNING, processes.self_pid)
    assert status.comm == "sleep"
    assert status.uid == processes.uid
    assert status.kernel_thread is False


def test_status_of_a_zombie(processes: ProcessHarness) -> None:
    pid = processes.zombie()
    status = processes.table.status(pid)
    assert status.state is PidState.ZOMBIE
    assert status.ppid == processes.self_pid


def test_status_of_a_stopped_child_and_sigcont(processes: ProcessHarness) -> None:
    pid = processes.stopped()
    assert processes.table.status(pid).state is PidState.STOPPED
    handle = processes.table.open(pid)
    assert handle is not None
    assert handle.state() is PidState.STOPPED
    assert handle.signal(signal.SIGCONT) is True
    assert processes.wait_state(pid, PidState.RUNNING) is PidState.RUNNING
    assert handle.state() is PidState.RUNNING
    handle.close()


def test_sigkill_leaves_an_unreaped_child_a_zombie(processes: ProcessHarness) -> None:
    pid = processes.spawn()
    handle = processes.table.open(pid)
    assert handle is not None
    assert handle.wait_exit(0.05) is False
    assert handle.signal(signal.SIGKILL) is True
    assert handle.wait_exit(5.0) is True
    assert processes.wait_state(pid, PidState.ZOMBIE) is PidState.ZOMBIE
    assert handle.state() is PidState.ZOMBIE
    handle.close()


def test_tree_includes_children_root_first(processes: ProcessHarness) -> None:
    root, children = processes.spawn_tree()
    tree = processes.table.tree(root)
    assert tree[0].pid == root
    assert tree[0].ppid == processes.self_pid
    assert tree[0].uid == processes.uid
    assert sorted(p.pid for p in tree[1:]) == sorted(children)
    for fact in tree[1:]:
        assert fact.ppid == root
        assert fact.comm == "sleep"
        assert fact.threads >= 1


def test_tree_of_a_leaf_is_itself(processes: ProcessHarness) -> None:
    pid = processes.spawn()
    assert [p.pid for p in processes.table.tree(pid)] == [pid]


def test_tree_of_a_free_pid_raises(processes: ProcessHarness) -> None:
    pid = processes.free_pid()
    with pytest.raises(ProcessNotFound) as info:
        processes.table.tree(pid)
    assert info.value.pid == pid


def test_ancestors_of_a_child_include_the_test_process(processes: ProcessHarness) -> None:
    root, children = processes.spawn_tree()
    chain = processes.table.ancestors(children[0])
    assert chain[:2] == (root, processes.self_pid)
    assert chain[-1] == 1
    assert children[0] not in chain


def test_no_handle_on_a_free_pid(processes: ProcessHarness) -> None:
    assert processes.table.open(processes.free_pid()) is None


def test_handle_checks_the_start_time(processes: ProcessHarness) -> None:
    pid = processes.spawn()
    start = processes.table.status(pid).start_time
    assert start > 0
    assert processes.table.open(pid, start + 1) is None
    handle = processes.table.open(pid, start)
    assert handle is not None
    assert (handle.pid, handle.start_time) == (pid, start)
    assert handle.signal(0) is True
    assert processes.table.status(pid).state is PidState.RUNNING
    handle.close()
    handle.close()  # idempotent
    assert handle.signal(0) is False


@needs_root_for_real
def test_a_handle_never_reaches_a_process_that_took_its_pid(processes: ProcessHarness) -> None:
    """The process exits, is reaped, and its pid goes to a newcomer: the handle reaches
    nothing, and reopening with the recorded start time finds nothing."""
    pid = processes.spawn()
    handle = processes.table.open(pid)
    assert handle is not None
    # Start times count clock ticks (10 ms): a newcomer can share one only with a process
    # that lived less than a tick. Ours lives longer, as any process ckptd dumps does.
    time.sleep(0.03)
    assert processes.reuse_pid(pid) == pid
    newcomer = processes.table.status(pid)
    assert newcomer.state is PidState.RUNNING
    assert handle.state() is PidState.FREE
    assert handle.signal(signal.SIGKILL) is False
    assert handle.wait_exit(0.0) is True
    assert processes.table.open(pid, handle.start_time) is None
    time.sleep(0.05)
    assert processes.table.status(pid).state is PidState.RUNNING  # the newcomer lives
    assert processes.table.status(pid).start_time == newcomer.start_time
    handle.close()


def test_a_process_in_the_daemons_namespaces_has_none_of_its_own(
    processes: ProcessHarness,
) -> None:
    pid = processes.spawn()
    assert processes.table.foreign_namespaces(pid) == frozenset()
    assert processes.table.status(pid).ns_pids == (pid,)
    assert all(f.ns_pid == 0 and f.image_pid == pid for f in processes.table.tree(pid))


@needs_root_for_real
def test_tree_of_a_pid_namespace_init_names_its_pids_inside(processes: ProcessHarness) -> None:
    root, children = processes.spawn_pidns_tree()
    assert "pid" in processes.table.foreign_namespaces(root)
    assert processes.table.status(root).ns_pids == (root, 1)
    tree = processes.table.tree(root)
    assert [f.pid for f in tree] == [root, *children]
    assert tree[0].image_pid == 1
    inner = sorted(f.ns_pid for f in tree[1:])
    assert len(inner) == 2 and all(p > 1 for p in inner)
    assert all(f.start_time > 0 for f in tree)


@needs_root_for_real
def test_the_init_of_a_pid_namespace_is_found_from_its_processes(
    processes: ProcessHarness,
) -> None:
    """A process of a pid namespace (not its init) finds the init, with which it shares
    every namespace; the init finds itself; a process of the daemon's namespace has none."""
    root, children = processes.spawn_pidns_tree()
    assert processes.table.pid_namespace_init(children[0]) == root
    assert processes.table.pid_namespace_init(root) == root
    assert processes.table.pid_namespace_init(processes.spawn()) == 0
    assert processes.table.namespaces_differing(children[0], root) == frozenset()
    assert processes.table.namespaces_differing(root, processes.self_pid) == {"pid"}
    gone = processes.free_pid()
    assert "pid" in processes.table.namespaces_differing(root, gone)
    assert processes.table.pid_namespace_init(gone) == 0


def _stdout(processes: ProcessHarness, pid: int) -> StdioFact:
    facts = processes.table.stdio(processes.table.tree(pid))
    assert sorted(f.fd for f in facts) == [0, 1, 2]
    assert {f.pid for f in facts} == {pid}
    (stdout,) = [f for f in facts if f.fd == 1]
    (stdin,) = [f for f in facts if f.fd == 0]
    assert stdin.kind is StdioKind.DEVNULL
    assert stdin.external_key == ""
    return stdout


def test_stdout_on_a_pipe_we_hold_is_external(processes: ProcessHarness) -> None:
    pid = processes.spawn_with_stdout("pipe")
    stdout = _stdout(processes, pid)
    assert stdout.kind is StdioKind.PIPE
    assert stdout.writable is True
    assert re.fullmatch(r"pipe:\[[0-9]+\]", stdout.external_key)
    assert stdout.external_key == stdout.target


def test_stdout_on_dev_null(processes: ProcessHarness) -> None:
    stdout = _stdout(processes, processes.spawn_with_stdout("devnull"))
    assert stdout.kind is StdioKind.DEVNULL
    assert stdout.external_key == ""
    assert stdout.target == os.devnull


def test_stdout_on_a_regular_file(processes: ProcessHarness) -> None:
    stdout = _stdout(processes, processes.spawn_with_stdout("file"))
    assert stdout.kind is StdioKind.FILE
    assert stdout.external_key == ""
    assert stdout.target.endswith("stdout.txt")
    assert stdout.on_restore == "reopened at its path and offset"


def test_uid_of_a_process_with_mixed_uids_is_consistent(
    processes: ProcessHarness,
) -> None:
    """A process whose real uid is 1000 but effective and saved uids are 0 (a set-uid-root
    program run by uid 1000) is root's: ``status`` and ``tree`` must both say uid 0, or a
    non-root caller could act on a privileged process inside its own tree."""
    if processes.real and os.geteuid() != 0:
        pytest.skip("making a process with mixed uids needs root")
    pid = processes.spawn_mixed_uid(real_uid=1000)
    assert processes.table.status(pid).uid == 0
    assert processes.table.tree(pid)[0].uid == 0


@pytest.mark.parametrize("keep", ["fd", "mapped"])
def test_a_process_holding_an_io_uring_is_named(
    processes: ProcessHarness, keep: UringKeep
) -> None:
    """An io_uring held by an fd, or only by a mapping of its rings once the fd is closed."""
    plain = processes.spawn()
    uring = processes.spawn_io_uring(keep)
    table = processes.table
    assert table.io_uring_holders(table.tree(uring)) == (uring,)
    assert table.io_uring_holders(table.tree(plain)) == ()
    both = (*table.tree(plain), *table.tree(uring))
    assert table.io_uring_holders(both) == (uring,)


def test_a_process_gone_holds_no_io_uring(processes: ProcessHarness) -> None:
    pid = processes.spawn_io_uring("fd")
    tree = processes.table.tree(pid)
    handle = processes.table.open(pid)
    assert handle is not None
    assert handle.signal(signal.SIGKILL) is True
    assert handle.wait_exit(5.0) is True
    handle.close()
    assert processes.table.io_uring_holders(tree) == ()


@needs_root_for_real
def test_reserving_pids_moves_a_pid_namespace_counter_up_never_down(
    processes: ProcessHarness,
) -> None:
    """What ``ckptctl run`` asks for in a container: the namespace's next pids are above the
    number (the counter is never lowered); in the daemon's namespace nothing is done."""
    root, children = processes.spawn_pidns_tree()
    assert processes.table.reserve_pids(children[0], 1000) >= 1000
    assert processes.table.reserve_pids(root, 500) >= 1000  # never lowered
    assert processes.table.reserve_pids(processes.spawn(), 1000) == 0
    with pytest.raises(ProcessNotFound):
        processes.table.reserve_pids(processes.free_pid(), 1000)
