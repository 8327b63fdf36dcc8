"""``FakeProcessTable``: a ``ProcessTable`` over a dict of fake processes."""

from __future__ import annotations

import signal as _signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from ckptd.domain import PidState, PidStatus, ProcessFact, StdioFact, StdioKind, TcpConnection
from ckptd.errors import ProcessNotFound
from ckptd.testing._clock import FakeClock

if TYPE_CHECKING:
    from ckptd.core.ports import ProcessTable

KillMode = Literal["zombie", "free"]
"""What SIGKILL leaves behind: a zombie (until ``reap``) or a free pid."""

_STOP_SIGNALS = frozenset({_signal.SIGSTOP, _signal.SIGTSTP, _signal.SIGTTIN, _signal.SIGTTOU})


def _signal_name(signo: int) -> str:
    try:
        return _signal.Signals(signo).name
    except ValueError:
        return str(signo)


@dataclass
class FakeProcess:
    """One fake process; mutable, so a test may change ``state`` or ``uid`` directly.

    ``stdio`` holds the ``StdioFact`` s that ``FakeProcessTable.stdio`` reports for it.
    """

    pid: int
    ppid: int
    comm: str = "proc"
    uid: int = 0
    gid: int = 0
    state: PidState = PidState.RUNNING
    kernel_thread: bool = False
    cmdline: tuple[str, ...] = ()
    threads: int = 1
    stdio: tuple[StdioFact, ...] = ()
    session: int = -1
    start_time: int = 0
    ns_pid: int = 0
    """Its pid in the pid namespace of the tree root it belongs to (0: the daemon's)."""
    namespaces: frozenset[str] = frozenset()
    """The namespaces it does not share with the daemon (``foreign_namespaces``)."""
    ns_owner: int = 0
    """Whose namespaces (of those in ``namespaces``) it is in: two processes share a foreign
    namespace when it is in both sets and their ``ns_owner`` is equal (0: its own)."""
    pidns_init: int = 0
    """The init of its pid namespace when that is not the daemon's (``pid_namespace_init``;
    0 with ``pid`` in ``namespaces``: itself when ``ns_pid`` is 1, else none found)."""
    tcp: tuple[tuple[str, str], ...] = ()
    """Its connected TCP sockets, ``(local, remote)`` each (``tcp_connections``)."""
    io_uring: bool = False
    """It holds an io_uring instance (``io_uring_holders``)."""
    own_root: bool = False
    """Its root directory is not the daemon's (``own_root``: a container's)."""
    tracer: int = 0
    """The pid tracing it (strace, gdb; 0: none)."""
    tgid: int = 0
    """Its process when it is a thread (0: itself)."""

    def fact(self) -> ProcessFact:
        """This process as ``ProcessTable.tree`` reports it."""
        return ProcessFact(
            pid=self.pid,
            ppid=self.ppid,
            comm=self.comm,
            cmdline=self.cmdline,
            uid=self.uid,
            gid=self.gid,
            threads=self.threads,
            start_time=self.start_time,
            ns_pid=self.ns_pid,
        )

    def pid_status(self) -> PidStatus:
        """This process as ``ProcessTable.status`` reports it."""
        return PidStatus(
            self.pid,
            self.state,
            ppid=self.ppid,
            comm=self.comm,
            uid=self.uid,
            kernel_thread=self.kernel_thread,
            traced=self.tracer != 0,
            tracer=self.tracer,
            tgid=self.tgid or self.pid,
            session=self.session,
            start_time=self.start_time,
            ns_pids=(self.pid, self.ns_pid) if self.ns_pid else (self.pid,),
        )


class FakeHandle:
    """A ``ProcessHandle`` on one ``FakeProcess`` object: once that object has left the
    table (reaped) — even if a new process now has its pid — or the handle is closed, it
    reaches nothing."""

    def __init__(self, table: FakeProcessTable, proc: FakeProcess) -> None:
        self._table = table
        self._proc = proc
        self.closed = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def start_time(self) -> int:
        return self._proc.start_time

    def signal(self, signo: int) -> bool:
        return not self.closed and self._table._deliver(self._proc, signo)

    def state(self) -> PidState:
        with self._table._lock:
            if self.closed or self._table.processes.get(self._proc.pid) is not self._proc:
                return PidState.FREE
            return self._proc.state

    def wait_exit(self, timeout_s: float) -> bool:
        """Never blocks: a fake process exits only when a test or a signal makes it."""
        del timeout_s
        return self.state() in (PidState.ZOMBIE, PidState.FREE)

    def close(self) -> None:
        self.closed = True


class FakeProcessTable:
    """A ``ProcessTable`` (see ``ckptd.core.ports``) over ``processes``, a dict pid -> process.

    Behaviour, mirroring ``ProcFsTable`` on Linux:

    - ``status`` of a pid not in the dict is ``PidState.FREE``;
    - ``tree(pid)`` is the process and its descendants (by ``ppid``), root first then
      breadth first, children in pid order; raises ``ProcessNotFound`` for a free pid;
    - ``ancestors(pid)`` follows ``ppid`` up to pid 1 (included) or to a pid not in the table;
    - ``stdio(tree)`` concatenates the ``stdio`` of each process of ``tree``;
    - ``io_uring_holders(tree)`` names the processes of ``tree`` with ``io_uring`` set, zombies
      excepted;
    - ``open(pid, start_time)`` gives a ``FakeHandle`` bound to the process object at ``pid``
      (None when free, or when ``start_time`` is given and differs); every process gets a
      distinct start time when added (unless one is given);
    - a handle's ``signal`` (and the test helper ``signal(pid, signo)``) records
      ``(pid, signo)`` in ``signals`` only when delivered, and returns False when its process
      is gone. Effects: SIGKILL terminates the process
      (``kill_mode``: "zombie" leaves a zombie until ``reap``, "free" frees the pid; its live
      children are re-parented to pid 1); SIGSTOP/SIGTSTP/SIGTTIN/SIGTTOU stop a running
      process; SIGCONT resumes a stopped one; a zombie ignores everything; any other signal is
      only recorded.

    When ``events`` is given, every signal appends ``"signal <pid> <SIGNAME>"`` to it, so a
    test can check the order against other fakes sharing the list. ``watchers``: callables
    told ``(pid, state)`` each time a process goes from RUNNING to STOPPED or back (a signal,
    ``set_state``) and on ``tell_watchers``, inside the table's lock (a watcher must not call
    the table). Thread-safe.
    """

    def __init__(self, *, kill_mode: KillMode = "free", events: list[str] | None = None) -> None:
        self._lock = threading.RLock()
        self.kill_mode: KillMode = kill_mode
        self.events = events
        self.processes: dict[int, FakeProcess] = {}
        self.pid_counters: dict[int, int] = {}
        """Pid-namespace counters raised by ``reserve_pids``, by the namespace init's pid."""
        self.signals: list[tuple[int, int]] = []
        """Every signal delivered, as ``(pid, signo)``, in order."""
        self._next_start = 1000
        self.handles: list[FakeHandle] = []
        """Every handle ``open`` gave out (a test may check they were all closed)."""
        self.watchers: list[Callable[[int, PidState], None]] = []
        """Told ``(pid, state)`` of every RUNNING <-> STOPPED change (class doc)."""

    # ---- set-up helpers --------------------------------------------------------------------

    def add_process(
        self,
        pid: int,
        ppid: int = 1,
        *,
        comm: str = "proc",
        uid: int = 0,
        gid: int | None = None,
        state: PidState = PidState.RUNNING,
        kernel_thread: bool = False,
        cmdline: Sequence[str] | None = None,
        threads: int = 1,
        stdio: Sequence[StdioFact] = (),
        session: int = -1,
        start_time: int = 0,
        ns_pid: int = 0,
        namespaces: frozenset[str] = frozenset(),
        io_uring: bool = False,
        ns_owner: int = 0,
        pidns_init: int = 0,
    ) -> FakeProcess:
        """Add a process (``gid`` defaults to ``uid``, ``cmdline`` to ``(comm,)``, ``start_time``
        to a new one). Raises ValueError if ``pid`` is taken or ``state`` is FREE."""
        if pid <= 0:
            raise ValueError(f"invalid pid {pid}")
        if state is PidState.FREE:
            raise ValueError("a fake process cannot be FREE; use remove()")
        with self._lock:
            if pid in self.processes:
                raise ValueError(f"pid {pid} is already in the fake process table")
            proc = FakeProcess(
                pid=pid,
                ppid=ppid,
                comm=comm,
                uid=uid,
                gid=uid if gid is None else gid,
                state=state,
                kernel_thread=kernel_thread,
                cmdline=tuple(cmdline) if cmdline is not None else (comm,),
                threads=threads,
                stdio=tuple(stdio),
                session=session,
                start_time=start_time or self._new_start_time(),
                ns_pid=ns_pid,
                namespaces=frozenset(namespaces),
                io_uring=io_uring,
                ns_owner=ns_owner,
                pidns_init=pidns_init,
            )
            self.processes[pid] = proc
            return proc

    def _new_start_time(self) -> int:
        self._next_start += 1
        return self._next_start

    def add_tree(
        self, root: int, *children: int, ppid: int = 1, uid: int = 0, comm: str = "job"
    ) -> tuple[FakeProcess, ...]:
        """Add ``root`` (parent ``ppid``) and ``children`` (parent ``root``), all running and
        owned by ``uid``; returns them root first. Children are named ``<comm>-child``."""
        with self._lock:
            out = [self.add_process(root, ppid, comm=comm, uid=uid)]
            out.extend(
                self.add_process(child, root, comm=f"{comm}-child", uid=uid) for child in children
            )
            return tuple(out)

    def set_stdio(self, pid: int, *facts: StdioFact) -> None:
        """Replace the stdio facts of ``pid``."""
        with self._lock:
            self.processes[pid].stdio = tuple(facts)

    def standard_stdio(
        self, pid: int, kind: StdioKind = StdioKind.DEVNULL, target: str = "/dev/null"
    ) -> tuple[StdioFact, ...]:
        """Give ``pid`` descriptors 0-2 all on one non-external ``target``; returns them."""
        facts = tuple(StdioFact(pid, fd, kind, target, fd != 0) for fd in (0, 1, 2))
        self.set_stdio(pid, *facts)
        return facts

    def remove(self, pid: int) -> None:
        """Free ``pid`` at once (the process exited and was reaped). No-op if free."""
        with self._lock:
            self.processes.pop(pid, None)

    def terminate(self, pid: int) -> None:
        """What SIGKILL does, without recording a signal (used by ``FakeCriu`` to model CRIU
        killing a dumped tree): zombie or free per ``kill_mode``; live children re-parented
        to pid 1. No-op if ``pid`` is free or already a zombie."""
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or proc.state is PidState.ZOMBIE:
                return
            for child in self.processes.values():
                if child.ppid == pid and child.pid != pid:
                    child.ppid = 1
            if self.kill_mode == "zombie":
                proc.state = PidState.ZOMBIE
            else:
                del self.processes[pid]

    def reap(self, pid: int) -> None:
        """The parent reaps the zombie ``pid``: the pid becomes free. ValueError if ``pid`` is
        not a zombie."""
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or proc.state is not PidState.ZOMBIE:
                raise ValueError(f"pid {pid} is not a zombie")
            del self.processes[pid]

    def reap_after(self, clock: FakeClock, pid: int, sleeps: int) -> None:
        """Reap the zombie ``pid`` once ``clock`` has slept ``sleeps`` more times (>= 1); if
        it is no longer a zombie by then, nothing happens."""
        if sleeps < 1:
            raise ValueError("sleeps must be >= 1; use reap() to reap now")
        count = 0

        def on_sleep(_seconds: float) -> None:
            nonlocal count
            count += 1
            if count < sleeps:
                return
            remove()
            with self._lock:
                proc = self.processes.get(pid)
                if proc is not None and proc.state is PidState.ZOMBIE:
                    del self.processes[pid]

        remove = clock.on_sleep(on_sleep)

    def children(self, pid: int) -> tuple[int, ...]:
        """Pids whose parent is ``pid``, ascending."""
        with self._lock:
            return tuple(
                sorted(p.pid for p in self.processes.values() if p.ppid == pid and p.pid != pid)
            )

    def state(self, pid: int) -> PidState:
        """Shorthand for ``status(pid).state``."""
        return self.status(pid).state

    def set_state(self, pid: int, state: PidState) -> None:
        """Put the process at ``pid`` in ``state`` (as a fake CRIU seizes or lets go of it),
        telling the ``watchers`` of a change; a free pid or a zombie is left as it is."""
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or proc.state is PidState.ZOMBIE or proc.state is state:
                return
            proc.state = state
            self._changed(pid, state)

    def stop_pending(self, pid: int, since: int) -> bool:
        """Whether the last stop or SIGCONT among the signals sent to ``pid`` after the first
        ``since`` of ``signals`` was a stop signal: what a process seized by a tracer then
        does once detached (the kernel delivers the signal as the tracer lets go)."""
        with self._lock:
            last = [signo for target, signo in self.signals[since:] if target == pid
                    and (signo in _STOP_SIGNALS or signo == _signal.SIGCONT)]
            return bool(last) and last[-1] in _STOP_SIGNALS

    def tell_watchers(self, pid: int) -> None:
        """Tell the ``watchers`` the state of ``pid`` again (a fake holder let its threads
        go: they run now if it is RUNNING). Nothing for a free pid."""
        with self._lock:
            proc = self.processes.get(pid)
            if proc is not None:
                self._changed(pid, proc.state)

    def _changed(self, pid: int, state: PidState) -> None:
        for watcher in list(self.watchers):
            watcher(pid, state)

    def signals_to(self, pid: int) -> list[int]:
        """The signal numbers sent to ``pid``, in order."""
        with self._lock:
            return [signo for target, signo in self.signals if target == pid]

    # ---- the ProcessTable port ---------------------------------------------------------

    def status(self, pid: int) -> PidStatus:
        """``PidState.FREE`` when ``pid`` is not in the table, else the process's status."""
        with self._lock:
            proc = self.processes.get(pid)
            return PidStatus(pid, PidState.FREE) if proc is None else proc.pid_status()

    def tree(self, pid: int) -> tuple[ProcessFact, ...]:
        """``pid`` then its descendants breadth first. Raises ProcessNotFound when free."""
        with self._lock:
            if pid not in self.processes:
                raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
            out = [self.processes[pid].fact()]
            seen = {pid}
            queue = list(self.children(pid))
            while queue:
                child = queue.pop(0)
                if child in seen:
                    continue
                seen.add(child)
                out.append(self.processes[child].fact())
                queue.extend(self.children(child))
            return tuple(out)

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """Parent, grandparent, ... up to pid 1, like ``ProcFsTable.ancestors``."""
        chain: list[int] = []
        current = pid
        with self._lock:
            while current > 1:
                proc = self.processes.get(current)
                if proc is None:
                    break
                current = proc.ppid
                if current <= 0 or current in chain:
                    break
                chain.append(current)
        return tuple(chain)

    def stdio(self, tree: Sequence[ProcessFact]) -> tuple[StdioFact, ...]:
        """The configured stdio facts of every process of ``tree`` still in the table."""
        with self._lock:
            out: list[StdioFact] = []
            for fact in tree:
                proc = self.processes.get(fact.pid)
                if proc is not None:
                    out.extend(replace(s, pid=fact.pid) for s in proc.stdio)
            return tuple(out)

    def open(self, pid: int, start_time: int = 0) -> FakeHandle | None:
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or (start_time and proc.start_time != start_time):
                return None
            handle = FakeHandle(self, proc)
            self.handles.append(handle)
            return handle

    def foreign_namespaces(self, pid: int) -> frozenset[str]:
        with self._lock:
            proc = self.processes.get(pid)
            return proc.namespaces if proc is not None else frozenset()

    def pid_namespace_init(self, pid: int) -> int:
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or "pid" not in proc.namespaces:
                return 0
            if proc.pidns_init:
                return proc.pidns_init
            return pid if proc.ns_pid == 1 else 0

    def namespaces_differing(self, pid: int, other: int) -> frozenset[str]:
        every = frozenset({"pid", "mnt", "net", "ipc", "uts", "user", "cgroup", "time"})
        with self._lock:
            one, two = self.processes.get(pid), self.processes.get(other)
            if one is None or two is None:
                return every
            differ = set(one.namespaces ^ two.namespaces)
            if (one.ns_owner or one.pid) != (two.ns_owner or two.pid):
                differ |= one.namespaces & two.namespaces
            return frozenset(differ)

    def own_root(self, pid: int) -> bool:
        with self._lock:
            proc = self.processes.get(pid)
            return proc is not None and proc.own_root

    def ns_pid_taken(self, init: int, ns_pid: int) -> str:
        """The comm of a live process whose ``pidns_init`` is ``init`` (or ``init`` itself
        for ns pid 1) and whose ``ns_pid`` is ``ns_pid``; "" when none."""
        with self._lock:
            if init not in self.processes:
                raise ProcessNotFound(f"no process with pid {init}", pid=init)
            for proc in self.processes.values():
                if proc.state is PidState.FREE:  # a zombie still holds its pid
                    continue
                mine = init in (proc.pid, proc.pidns_init)
                if mine and (proc.ns_pid or proc.pid) == ns_pid:
                    return proc.comm
            return ""

    def reserve_pids(self, pid: int, above: int, start_time: int = 0) -> int:
        """Its pid namespace's counter (``pid_counters``, by the namespace's init, 0 at
        first) raised to ``above``; 0 when ``pid`` shares the daemon's pid namespace."""
        with self._lock:
            proc = self.processes.get(pid)
            if proc is None or (start_time and proc.start_time != start_time):
                raise ProcessNotFound(f"no process with pid {pid}", pid=pid)
            if "pid" not in proc.namespaces:
                return 0
            key = self._pid_ns_root(proc)
            self.pid_counters[key] = max(self.pid_counters.get(key, 0), above)
            return self.pid_counters[key]

    def _pid_ns_root(self, proc: FakeProcess) -> int:
        """The node pid of the init of ``proc``'s pid namespace (ns_pid 1), or its own."""
        while proc.ns_pid != 1 and proc.ppid in self.processes:
            parent = self.processes[proc.ppid]
            if "pid" not in parent.namespaces:
                break
            proc = parent
        return proc.pid

    def tcp_connections(self, tree: Sequence[ProcessFact]) -> tuple[TcpConnection, ...]:
        out = []
        with self._lock:
            for fact in tree:
                proc = self.processes.get(fact.pid)
                for n, (local, remote) in enumerate(proc.tcp if proc is not None else ()):
                    out.append(TcpConnection(fact.pid, proc.comm if proc else "", local, remote,
                                             "ESTABLISHED", fact.pid * 1000 + n))
        return tuple(out)

    def io_uring_holders(self, tree: Sequence[ProcessFact]) -> tuple[int, ...]:
        """The pids of ``tree`` whose process in the table has ``io_uring`` set (a zombie
        holds none)."""
        with self._lock:
            return tuple(
                fact.pid for fact in tree
                if (proc := self.processes.get(fact.pid)) is not None and proc.io_uring
                and proc.state is not PidState.ZOMBIE  # its descriptors and memory are gone
            )

    def signal(self, pid: int, signo: int) -> bool:
        """Test helper (not part of the port): signal whatever process is at ``pid`` now."""
        with self._lock:
            proc = self.processes.get(pid)
            return False if proc is None else self._deliver(proc, signo)

    def _deliver(self, proc: FakeProcess, signo: int) -> bool:
        """Apply ``signo`` to ``proc`` if it is still in the table (see the class doc)."""
        with self._lock:
            if self.processes.get(proc.pid) is not proc:
                return False
            pid = proc.pid
            self.signals.append((pid, signo))
            if self.events is not None:
                self.events.append(f"signal {pid} {_signal_name(signo)}")
            if proc.state is PidState.ZOMBIE or signo == 0:
                return True
            if signo == _signal.SIGKILL:
                self.terminate(pid)
            elif signo in _STOP_SIGNALS:
                if proc.state is PidState.RUNNING:
                    proc.state = PidState.STOPPED
                    self._changed(pid, proc.state)
            elif signo == _signal.SIGCONT and proc.state is PidState.STOPPED:
                proc.state = PidState.RUNNING
                self._changed(pid, proc.state)
            return True

if TYPE_CHECKING:

    def _is_a_process_table(table: FakeProcessTable) -> ProcessTable:
        return table
