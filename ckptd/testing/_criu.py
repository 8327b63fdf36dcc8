"""``FakeCriu``: the ``Criu`` port without CRIU, over a ``FakeProcessTable``."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.core.ports import (
    CriuDumpJob,
    CriuDumpResult,
    CriuHooks,
    CriuPaths,
    CriuRestoreJob,
    ImageSource,
)
from ckptd.domain import CriuStatus, PidState, ProcessFact, StdioFact, StdioKind, TcpConnection
from ckptd.errors import CkptdError, CriuFailed, CriuUnavailable
from ckptd.testing._cgroups import FakeCgroups
from ckptd.testing._clock import FakeClock
from ckptd.testing._processes import FakeProcessTable

if TYPE_CHECKING:
    from ckptd.core.ports import Criu

DUMP_HOOKS = ("pre_dump", "network_lock", "post_dump", "network_unlock")
"""The dump notifications, in the order CRIU sends them."""
RESTORE_HOOKS = ("pre_restore", "setup_namespaces", "post_restore", "pre_resume", "post_resume")
"""The restore notifications, in the order CRIU sends them."""

CRIU_PIDS = 900001
"""The pids ``FakeCriu`` gives its own process, one per restore (never in the table)."""
LAZY_PIDS = 950001
"""The pids of ``FakeCriu``'s page daemon, one per lazy restore: in the table while it serves
the restore's pages."""

PSTREE_IMAGE = "pstree.img"
INVENTORY_IMAGE = "inventory.img"
PAGE_SIZE = 4096


class _Abort(Exception):
    """Internal: unwinds a fake operation at a failure point."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class FakeCriu:
    """A ``Criu`` (see ``ckptd.core.ports``) that acts on a ``FakeProcessTable``.

    Records: ``dump_jobs``, ``restore_jobs``, ``status_calls`` and ``hook_calls`` (``(hook
    name, pid)`` in call order). With ``events``, appends ``"criu.dump <pid>"``,
    ``"criu.hook <name>"``, ``"criu.dumped <pid>"`` (images written), ``"criu.finished
    <pid>"``, ``"criu.restore"``, ``"criu.restored <pid>"`` and ``"criu.failed"``.

    Status: ``criu_status`` is what ``status()`` returns; ``set_status(False, "...")`` makes
    both ``dump`` and ``restore`` raise ``CriuUnavailable`` (like ``CriuSwrk``).

    Dump, like CRIU: calls ``pre_dump``; seizes the tree as it is then (its processes show
    STOPPED) and writes ``inventory.img``; ``network_lock``; writes ``pstree.img`` (the tree,
    its stdio and which processes were stopped before, as JSON) and ``pages-<pid>.img``
    (``PAGE_SIZE`` bytes per process) into ``job.images_dir`` and ``dump.log`` into
    ``job.work_dir``; ``post_dump`` — and ``dump`` returns there, the tree held STOPPED (the
    ``CriuDumpInProgress`` port). ``finish`` then calls ``network_unlock`` and ends it:
    ``leave_running`` puts every process back in the state it had; else ``leave_stopped`` leaves
    them all STOPPED; else they are terminated (``FakeProcessTable.terminate``: no signal is
    recorded). ``abort`` puts every process back as it was (as CRIU does when its post-dump
    notification is answered with a failure). A process sent a stop signal while seized (and no
    SIGCONT after it) comes back STOPPED from ``finish`` and ``abort``, as the kernel delivers
    it when CRIU detaches (``FakeProcessTable.stop_pending``). With a ``clock``, the tree stays
    frozen for ``frozen_s`` of it (a restore takes ``restore_s``). Both directories must exist
    (else ``CriuFailed``), as must the root. ``pids`` (and the result's) are the seized tree's
    as CRIU's images name them (``image_pid``: pids in the root's pid namespace when it is the
    init of its own), root first; ``holds_connections`` is ``job.tcp_established``.

    Restore, like CRIU: reads the images (missing or bad -> ``CriuFailed``), calls
    ``pre_restore(0)``; fails if a pid of the tree is not free, or if a stdio
    ``external_key`` of the images has no ``InheritFd`` in the job or its fd is not open;
    ``setup_namespaces``; recreates the processes (the root's parent becomes pid 1; a tree
    that was the init of its own pid namespace gets new pids above every pid in use, keeping
    its ``ns_pid`` s, and the pid check is skipped as in a new namespace; with
    ``job.container`` the tree is born in that init's namespaces with new node pids, its
    ``ns_pid`` s kept (each must be free there: ``ns_pid_taken``) and the root that init's
    child; a process stopped before the dump comes back STOPPED, the others are held
    stopped until resumed);
    ``post_restore``, ``pre_resume``; resumes them; ``post_resume``; returns the root pid.
    Before all that it calls ``criu_started`` with a pid of its own (a new one each restore,
    not in the table); with ``cgroups`` (a ``FakeCgroups``) that pid is a process there, in
    its ``default`` cgroup, while the restore lasts, and with ``job.restore_cgroups`` false
    the tree is born in its cgroup (``FakeCgroups.fork``); a ``criu_started`` that raises
    fails the restore before anything (``CriuFailed``, the hook's error as cause).

    Lazy restore (``job.lazy``; it needs ``job.images`` and no ``job.container``, else
    ``CriuFailed`` as ``CriuSwrk``): first a page daemon of its own starts, a process of the
    table (pid from ``LAZY_PIDS``, ``comm`` "criu", parent pid 1), told to ``criu_started``
    (the adapter places it as it places CRIU) then to ``job.lazy.started``; the restore
    then runs as above. Once ``restore`` has returned, a thread of its own (``lazy_ends``;
    ``join_lazy`` waits for them) ends it, when ``pages_served`` is set (at once unless a test
    cleared it), as the adapter does: the daemon exits, then
    ``job.lazy.done(pages, 0.0)`` (``pages``: the pages images' size in pages); with
    ``fail_lazy``, ``job.lazy.failed(fail_lazy)`` first (a page that could not be served: the
    tree is the watch's to kill), then the daemon exits. A restore that fails stops the daemon
    and then tells ``failed`` (``CriuFailed``: the daemon hung up), as the adapter's serving
    thread does. Events: ``"criu.lazy_started <pid>"``, ``"criu.lazy_done <pages>"``,
    ``"criu.lazy_failed"``.

    Failures: ``fail_dump`` / ``fail_restore`` (an exception, typically ``CriuFailed``) is
    raised as is once the hook named by ``fail_dump_after`` / ``fail_restore_after`` has run
    ("" fails before the first hook). A hook that raises aborts the operation and becomes
    ``CriuFailed("CRIU ... aborted: <hook error>")`` with the hook's exception as
    ``__cause__``, like ``CriuSwrk``. An aborted dump leaves the tree exactly as it was
    (running) and may leave partial images; an aborted restore removes every process it
    created, even when ``post_resume`` raised (the port's promise: on failure nothing of the
    tree remains). Thread-safe for concurrent operations on distinct trees.
    """

    def __init__(
        self,
        processes: FakeProcessTable,
        *,
        version: str = "4.1",
        path: str = "/usr/local/sbin/criu",
        clock: FakeClock | None = None,
        events: list[str] | None = None,
        cgroups: FakeCgroups | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.processes = processes
        self.cgroups = cgroups
        self._criu_pids = itertools.count(CRIU_PIDS)
        self._lazy_pids = itertools.count(LAZY_PIDS)
        self.clock = clock
        self.events = events
        self.criu_status = CriuStatus(path, version, True, "Looks good.")
        self.status_calls = 0
        self.dump_jobs: list[CriuDumpJob] = []
        self.restore_jobs: list[CriuRestoreJob] = []
        self.hook_calls: list[tuple[str, int]] = []
        self.fail_dump: Exception | None = None
        self.fail_dump_after = "network_lock"
        self.fail_restore: Exception | None = None
        self.fail_restore_after = "setup_namespaces"
        self.streams_restore = False
        """What ``can_stream_restore`` says (a restore with ``job.images`` reads them)."""
        self.frozen_s = 0.25
        """How long a dump keeps the tree frozen (reported as ``frozen_s``)."""
        self.restore_s = 0.125
        """How long a restore takes on ``clock``."""
        self.fail_lazy: CkptdError | None = None
        """A lazy restore ends with ``job.lazy.failed(fail_lazy)`` instead of ``done``."""
        self.lazy_ends: list[threading.Thread] = []
        """The threads telling each lazy restore's end (``join_lazy``)."""
        self.pages_served = threading.Event()
        """Set: a lazy restore's pages are all served at once. Cleared, each lazy restore's
        end waits until it is set (a test looks at a restore whose pages are still coming)."""
        self.pages_served.set()
        self.paths = CriuPaths()
        """What ``restore_paths`` says CRIU would resolve by path (pair it with
        ``FakeJobFiles.opens``: what it then opened)."""
        self.fail_restore_paths: CkptdError | None = None
        self.locks_lost: tuple[str, ...] = ()
        """What ``lost_locks`` says of every dump's images."""

    # ---- helpers for tests -----------------------------------------------------------------

    def set_status(self, ok: bool, message: str = "") -> None:
        """Make ``status()`` say ok or not, with ``message`` (a default one if empty)."""
        self.criu_status = CriuStatus(
            self.criu_status.path,
            self.criu_status.version,
            ok,
            message or ("Looks good." if ok else "CRIU is not usable (FakeCriu)"),
        )

    def join_lazy(self, timeout: float = 10.0) -> None:
        """Wait until every lazy restore's end has been told (TimeoutError if one is not
        within ``timeout``: its ``LazyPages`` still waits, e.g. for the recipe to end)."""
        with self._lock:
            threads = list(self.lazy_ends)
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"a lazy restore's end was not told in {timeout:g}s")

    # ---- the Criu port ------------------------------------------------------------------

    def can_stream_restore(self) -> bool:
        return self.streams_restore

    def restore_paths(self, images_dir: Path, images: ImageSource | None) -> CriuPaths:
        """``paths`` (what a test says CRIU would resolve by path), or the error
        ``fail_restore_paths`` holds."""
        if self.fail_restore_paths is not None:
            raise self.fail_restore_paths
        return self.paths

    def lost_locks(self, images_dir: Path) -> tuple[str, ...]:
        """``locks_lost``."""
        return self.locks_lost

    def status(self) -> CriuStatus:
        """``criu_status``."""
        with self._lock:
            self.status_calls += 1
            return self.criu_status

    def dump(self, job: CriuDumpJob, hooks: CriuHooks) -> _FakeDumpInProgress:
        """Fake-dump the tree of ``job.pid`` up to ``post_dump`` (see the class doc)."""
        with self._lock:
            self.dump_jobs.append(job)
        self._event(f"criu.dump {job.pid}")
        status = self.criu_status
        if not status.ok:
            raise CriuUnavailable(status.message, pid=job.pid)
        what = f"dump of pid {job.pid}"
        for directory in (job.images_dir, job.work_dir):
            if not directory.is_dir():
                raise self._failed(what, f"cannot open {directory}", job.pid, errno=2)
        if self.processes.status(job.pid).state in (PidState.FREE, PidState.ZOMBIE):
            raise self._failed(what, f"no process with pid {job.pid}", job.pid, errno=3)
        tree = self.processes.tree(job.pid)
        before = {p.pid: self.processes.status(p.pid).state for p in tree}
        seized = False
        mark = 0
        try:
            self._hook(hooks, "pre_dump", job.pid, what, self.fail_dump, self.fail_dump_after)
            tree = self.processes.tree(job.pid)  # what CRIU seizes: the tree as it is now
            before = {p.pid: self.processes.status(p.pid).state for p in tree} | before
            self._set_states(tree, PidState.STOPPED)  # seized and frozen
            seized = True
            mark = len(self.processes.signals)
            (job.images_dir / INVENTORY_IMAGE).write_text(
                json.dumps({"fake_criu": True, "version": self.criu_status.version})
            )
            if self.clock is not None:
                self.clock.advance(self.frozen_s)
            self._hook(hooks, "network_lock", job.pid, what, self.fail_dump, self.fail_dump_after)
            self._write_images(job, tree, before)
            self._event(f"criu.dumped {job.pid}")
            self._hook(hooks, "post_dump", job.pid, what, self.fail_dump, self.fail_dump_after)
        except _Abort as abort:
            self._abandon(job, before if seized else {}, abort.error, mark)
            raise abort.error from abort.error.__cause__
        return _FakeDumpInProgress(self, job, hooks, tuple(tree), before, mark)

    def _abandon(self, job: CriuDumpJob, before: dict[int, PidState], error: Exception,
                 mark: int = 0) -> None:
        self._restore_states(self._detached(before, mark))
        self._log(job.work_dir / "dump.log", f"Error (fake-criu): {error}")
        self._event("criu.failed")

    def _finish_dump(
        self,
        job: CriuDumpJob,
        hooks: CriuHooks,
        tree: tuple[ProcessFact, ...],
        before: dict[int, PidState],
        mark: int = 0,
    ) -> CriuDumpResult:
        what = f"dump of pid {job.pid}"
        try:
            self._hook(
                hooks, "network_unlock", job.pid, what, self.fail_dump, self.fail_dump_after
            )
        except _Abort as abort:
            self._abandon(job, before, abort.error, mark)
            raise abort.error from abort.error.__cause__
        if job.leave_running:
            self._restore_states(self._detached(before, mark))
        elif not job.leave_stopped:
            for proc in tree:
                self.processes.terminate(proc.pid)
        self._log(job.work_dir / "dump.log", "Dumping finished successfully")
        self._event(f"criu.finished {job.pid}")
        return CriuDumpResult(
            frozen_s=self.frozen_s,
            freezing_s=self.frozen_s / 10,
            pages_written=len(tree),
            duration_s=self.frozen_s * 2,
            pids=tuple(p.image_pid for p in tree),
        )

    def restore(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        """Fake-restore the tree in ``job.images_dir`` (see the class doc)."""
        with self._lock:
            self.restore_jobs.append(job)
        self._event("criu.restore")
        status = self.criu_status
        if not status.ok:
            raise CriuUnavailable(status.message)
        helper = self._start_lazy(job, hooks) if job.lazy is not None else 0
        try:
            root = self._restore_by(job, hooks)
        except BaseException:
            if helper:  # the daemon stopped, then its end told
                self._lazy_exit(helper)
                self._end_lazy(job, helper, CriuFailed(
                    f"CRIU's lazy-pages daemon hung up after 0 pages of "
                    f"{job.images.checkpoint_id if job.images else ''}, before every page "
                    "was served", hint=""), 0, served=False)
            raise
        if helper:
            self._end_lazy(job, helper, self.fail_lazy, self._pages(job.images))
        return root

    def _restore_by(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        """The restore by a CRIU process of its own (``criu_started``)."""
        what = "restore"
        with self._lock:
            criu_pid = next(self._criu_pids)
        if self.cgroups is not None:
            self.cgroups.spawn(criu_pid)
        try:
            self._event(f"criu.started {criu_pid}")
            try:
                hooks.criu_started(criu_pid)
            except Exception as exc:
                error = self._failed(what, f"aborted before it began: {exc}", None,
                                     aborted=True)
                self._event("criu.failed")
                raise error from exc
            return self._restore(job, hooks, criu_pid)
        finally:
            if self.cgroups is not None:
                self.cgroups.exit(criu_pid)

    def _start_lazy(self, job: CriuRestoreJob, hooks: CriuHooks) -> int:
        """A lazy restore's page daemon started and told (see the class doc); its pid."""
        assert job.lazy is not None
        if job.images is None or job.container is not None:
            raise self._failed("restore", "a lazy restore reads its images from the store, "
                               "on the node", None)
        with self._lock:
            helper = next(self._lazy_pids)
        self.processes.add_process(helper, 1, comm="criu", cmdline=("criu", "lazy-pages"))
        self._event(f"criu.lazy_started {helper}")
        try:
            hooks.criu_started(helper)
        except Exception as exc:
            self._lazy_exit(helper)
            self._event("criu.failed")
            raise self._failed("restore", f"aborted before it began: {exc}", None,
                               aborted=True) from exc
        job.lazy.started(helper)
        return helper

    def _end_lazy(self, job: CriuRestoreJob, helper: int, error: CkptdError | None,
                  pages: int, *, served: bool = True) -> None:
        """Tell ``job.lazy`` how the restore's pages ended, from a thread (see the class
        doc): the recipe's ``LazyPages`` waits there until the recipe has ended. ``served``:
        pages were served (the end waits for ``pages_served``)."""
        lazy = job.lazy
        assert lazy is not None

        def end() -> None:
            if served:
                self.pages_served.wait()
            if error is None:
                self._lazy_exit(helper)
                self._event(f"criu.lazy_done {pages}")
                lazy.done(pages, 0.0)
                return
            self._event("criu.lazy_failed")
            lazy.failed(error)  # the tree killed; only then is the daemon let go
            self._lazy_exit(helper)

        thread = threading.Thread(target=end, name=f"fake lazy pages {helper}", daemon=True)
        with self._lock:
            self.lazy_ends.append(thread)
        thread.start()

    def _lazy_exit(self, helper: int) -> None:
        """The page daemon exits (idempotent)."""
        if self.processes.status(helper).state is not PidState.FREE:
            self.processes.remove(helper)
            if self.cgroups is not None:
                self.cgroups.exit(helper)

    @staticmethod
    def _pages(images: ImageSource | None) -> int:
        if images is None:
            return 0
        return sum(images.size(n) for n in images.names()
                   if n.startswith("pages-")) // PAGE_SIZE

    def _restore(self, job: CriuRestoreJob, hooks: CriuHooks, criu_pid: int) -> int:
        what = "restore"
        tree, stdio, stopped = self._read_images(job.images_dir, what, job.images)
        own_ns = tree[0].ns_pid == 1
        into = job.container
        if own_ns or into is not None:  # new node pids; the same pids in their namespace
            tree, stdio, stopped = self._renumbered(tree, stdio, stopped)
        root = tree[0].pid
        created: list[int] = []
        fail, after = self.fail_restore, self.fail_restore_after
        try:
            self._hook(hooks, "pre_restore", 0, what, fail, after)
            for proc in tree:
                if self.processes.status(proc.pid).state is not PidState.FREE:
                    raise _Abort(self._failed(what, f"can't fork for {proc.pid}: pid in use", root))
                if into is not None and self.processes.ns_pid_taken(into.init, proc.image_pid):
                    raise _Abort(self._failed(
                        what, f"can't fork for {proc.image_pid}: File exists", root))

            given = {i.key: i.fd for i in job.inherit_fds}
            for fact in stdio:
                if not fact.external_key:
                    continue
                if fact.external_key not in given:
                    raise _Abort(
                        self._failed(what, f"no inherit fd for {fact.external_key}", root)
                    )
                try:
                    os.fstat(given[fact.external_key])
                except OSError as exc:
                    raise _Abort(
                        self._failed(what, f"inherit fd {fact.external_key}: {exc}", root)
                    ) from exc
            self._hook(hooks, "setup_namespaces", root, what, fail, after)
            if self.clock is not None:
                self.clock.advance(self.restore_s)
            if into is not None:
                init = self.processes.processes[into.init]
                namespaces, owner = init.namespaces, init.ns_owner or into.init
            else:
                namespaces, owner = frozenset({"pid"}) if own_ns else frozenset(), 0
            for proc in tree:
                parent = (into.init if into is not None else 1) if proc.pid == root else proc.ppid
                self.processes.add_process(
                    proc.pid,
                    parent,
                    comm=proc.comm,
                    uid=proc.uid,
                    gid=proc.gid,
                    state=PidState.STOPPED,
                    cmdline=proc.cmdline,
                    threads=proc.threads,
                    stdio=[s for s in stdio if s.pid == proc.pid],
                    ns_pid=proc.ns_pid,
                    namespaces=namespaces,
                    ns_owner=owner,
                    pidns_init=into.init if into is not None else 0,
                )
                created.append(proc.pid)
                if self.cgroups is not None and not job.restore_cgroups:
                    self.cgroups.fork(proc.pid, criu_pid)
            self._hook(hooks, "post_restore", root, what, fail, after)
            self._hook(hooks, "pre_resume", root, what, fail, after)
            self._restore_states(
                {p: PidState.STOPPED if p in stopped or job.leave_stopped else PidState.RUNNING
                 for p in created}
            )
            self._hook(hooks, "post_resume", root, what, fail, after)
        except _Abort as abort:
            for pid in created:
                self.processes.remove(pid)
            self._log(job.work_dir / "restore.log", f"Error (fake-criu): {abort.error}")
            self._event("criu.failed")
            raise abort.error from abort.error.__cause__
        self._log(job.work_dir / "restore.log", "Restore finished successfully")
        self._event(f"criu.restored {root}")
        return root

    # ---- internals ------------------------------------------------------------------------

    def _renumbered(
        self, tree: tuple[ProcessFact, ...], stdio: tuple[StdioFact, ...], stopped: frozenset[int]
    ) -> tuple[tuple[ProcessFact, ...], tuple[StdioFact, ...], frozenset[int]]:
        """A new pid namespace: new node pids above every pid in use, same ``ns_pid`` s."""
        with self._lock:
            base = max([*self.processes.processes, 30000]) + 1
        new = {p.pid: base + i for i, p in enumerate(tree)}
        return (
            tuple(replace(p, pid=new[p.pid], ppid=new.get(p.ppid, p.ppid)) for p in tree),
            tuple(replace(s, pid=new.get(s.pid, s.pid)) for s in stdio),
            frozenset(new.get(p, p) for p in stopped),
        )

    def _event(self, text: str) -> None:
        if self.events is not None:
            self.events.append(text)

    def _hook(
        self,
        hooks: CriuHooks,
        name: str,
        pid: int,
        what: str,
        fail: Exception | None,
        fail_after: str,
    ) -> None:
        if fail is not None and fail_after == "" and name in (DUMP_HOOKS[0], RESTORE_HOOKS[0]):
            raise _Abort(fail)
        with self._lock:
            self.hook_calls.append((name, pid))
        self._event(f"criu.hook {name}")
        method: Callable[[int], None] = getattr(hooks, name)
        try:
            method(pid)
        except Exception as exc:
            error = self._failed(what, f"aborted: {exc}", pid or None, aborted=True)
            error.__cause__ = exc
            raise _Abort(error) from exc
        if fail is not None and fail_after == name:
            raise _Abort(fail)

    @staticmethod
    def _failed(
        what: str, detail: str, pid: int | None, *, errno: int | None = None, aborted: bool = False
    ) -> CriuFailed:
        message = f"CRIU {what} {detail}" if aborted else f"CRIU {what} failed: {detail}"
        return CriuFailed(
            message,
            errno=errno,
            log_tail=f"(00.000100) fake-criu\nError (fake-criu): {detail}",
            pid=pid,
        )

    def _set_states(self, tree: Sequence[ProcessFact], state: PidState) -> None:
        for proc in tree:
            self.processes.set_state(proc.pid, state)

    def _restore_states(self, states: dict[int, PidState]) -> None:
        for pid, state in states.items():
            self.processes.set_state(pid, state)

    def _detached(self, before: dict[int, PidState], mark: int) -> dict[int, PidState]:
        """The states CRIU leaves the seized processes in when it lets go of them: as they
        were (``before``), but stopped where a stop signal came while seized (among the
        signals after the first ``mark`` of the table's)."""
        return {pid: PidState.STOPPED if self.processes.stop_pending(pid, mark) else state
                for pid, state in before.items()}

    @staticmethod
    def _log(path: Path, line: str) -> None:
        if path.parent.is_dir():
            with path.open("a") as log:
                log.write(line + "\n")

    def _write_images(
        self, job: CriuDumpJob, tree: Sequence[ProcessFact], before: dict[int, PidState]
    ) -> None:
        images = job.images_dir
        stdio = self.processes.stdio(tree)
        pstree: dict[str, Any] = {
            "root": job.pid,
            "processes": [asdict(p) for p in tree],
            "stdio": [{**asdict(s), "kind": s.kind.value} for s in stdio],
            "stopped": sorted(p for p, s in before.items() if s is PidState.STOPPED),
        }
        (images / PSTREE_IMAGE).write_text(json.dumps(pstree))
        for proc in tree:
            (images / f"pages-{proc.pid}.img").write_bytes(
                proc.pid.to_bytes(4, "little") * (PAGE_SIZE // 4)
            )

    def _read_images(
        self, images: Path, what: str, source: ImageSource | None = None
    ) -> tuple[tuple[ProcessFact, ...], tuple[StdioFact, ...], frozenset[int]]:
        """The tree in ``images``, or (a streamed restore) in ``source``."""

        def text(name: str) -> str:
            if source is None:
                return (images / name).read_text()
            if not source.exists(name):
                raise FileNotFoundError(name)
            return b"".join(bytes(c) for c in source.chunks(name)).decode()

        def exists(name: str) -> bool:
            return (images / name).is_file() if source is None else source.exists(name)

        try:
            json.loads(text(INVENTORY_IMAGE))
            data = json.loads(text(PSTREE_IMAGE))
            tree = tuple(
                ProcessFact(**{**p, "cmdline": tuple(p["cmdline"])}) for p in data["processes"]
            )
            stdio = tuple(
                StdioFact(**{**s, "kind": StdioKind(s["kind"])}) for s in data["stdio"]
            )
            stopped = frozenset(int(p) for p in data["stopped"])
            for proc in tree:
                if not exists(f"pages-{proc.pid}.img"):
                    raise FileNotFoundError(f"pages-{proc.pid}.img")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise self._failed(what, f"cannot read images in {images}: {exc}", None) from exc
        if not tree:
            raise self._failed(what, f"empty process tree in {images}", None)
        return tree, stdio, stopped


class _FakeDumpInProgress:
    """``CriuDumpInProgress`` of a ``FakeCriu``: the tree held STOPPED at post-dump."""

    def __init__(
        self,
        criu: FakeCriu,
        job: CriuDumpJob,
        hooks: CriuHooks,
        tree: tuple[ProcessFact, ...],
        before: dict[int, PidState],
        mark: int = 0,
    ) -> None:
        self._criu = criu
        self._mark = mark
        self._job = job
        self._hooks = hooks
        self._tree = tree
        self._before = before
        self._ended = False
        self._result: CriuDumpResult | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.image_pid for p in self._tree)

    @property
    def holds_connections(self) -> bool:
        return self._job.tcp_established

    @property
    def tcp_sockets(self) -> tuple[TcpConnection, ...] | None:
        """The frozen tree's connections in the fake process table, as CRIU's images would
        hold them (pid 0)."""
        return tuple(replace(c, pid=0, comm="")
                     for c in self._criu.processes.tcp_connections(self._tree))

    def finish(self) -> CriuDumpResult:
        if self._result is not None:
            return self._result
        if self._ended:
            raise CriuFailed(f"CRIU dump of pid {self._job.pid} was aborted", pid=self._job.pid)
        self._ended = True
        self._result = self._criu._finish_dump(self._job, self._hooks, self._tree, self._before,
                                              self._mark)
        return self._result

    def abort(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._criu._abandon(self._job, self._before, RuntimeError("the dump was abandoned"),
                            self._mark)


if TYPE_CHECKING:

    def _is_a_criu(criu: FakeCriu) -> Criu:
        return criu
