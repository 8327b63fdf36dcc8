"""A ``criu swrk`` dump held at its post-dump notification: the ``CriuDumpInProgress`` port.

CRIU dumps in a thread of its own; at post-dump (the images complete, the tree frozen) the
conversation waits for the caller's decision: go on (``finish``: CRIU ends, the tree is
resumed or killed as the job says) or fail (``abort``: CRIU resumes the tree). With a page
sink, CRIU sends its pages to a ``PageServer`` over a socketpair instead of writing them.

Invariant: CRIU is answered exactly once at post-dump -- go on or fail, or the daemon's death
closing the socket -- and on a failure CRIU itself resumes the tree and unlocks its network.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ckptd.adapters.criu.images import read_dump_stats, read_pstree, read_tcp_connections
from ckptd.adapters.criu.pageserver import PageServer, PageServerError, wire_for
from ckptd.core.ports import CriuDumpJob, CriuDumpResult, CriuHooks, ForwardingHooks
from ckptd.domain import TcpConnection
from ckptd.errors import CriuFailed

log = logging.getLogger(__name__)

RunDump = Callable[[CriuDumpJob, CriuHooks, "Callable[[int], None] | None"], None]
"""Runs one CRIU dump of a job with these hooks (and a ``started`` callback) to its end."""


class _Abandoned(Exception):
    """Answers CRIU's post-dump notification with a failure: CRIU resumes the tree."""


class SwrkDump:
    """One ``criu swrk`` dump, run in a thread and held at its post-dump notification (the
    ``CriuDumpInProgress`` port). Invariant: CRIU is answered exactly once at post-dump — go
    on (``finish``) or fail (``abort``, or the daemon's death closing the socket) — and on a
    failure CRIU itself resumes the tree and unlocks its network."""

    def __init__(self, run: RunDump, criu_version: str, job: CriuDumpJob,
                 hooks: CriuHooks) -> None:
        self._run_dump = run
        self._job = job
        self._hooks = hooks
        self._started = time.monotonic()
        self._held = threading.Event()
        self._decided = threading.Event()
        self._proceed = False
        self._reached = False
        self._ended = False
        self._error: BaseException | None = None
        self._result: CriuDumpResult | None = None
        self._pids: tuple[int, ...] = ()
        self._tcp: tuple[TcpConnection, ...] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"criu-dump-{job.pid}", daemon=True
        )
        self._server: PageServer | None = None
        if job.page_sink is not None and job.container is None:
            self._server = PageServer(job.images_dir, job.page_sink,
                                      wire=wire_for(criu_version))

    @property
    def pids(self) -> tuple[int, ...]:
        return self._pids

    @property
    def holds_connections(self) -> bool:
        return self._job.tcp_established

    @property
    def tcp_sockets(self) -> tuple[TcpConnection, ...] | None:
        return self._tcp

    def start(self) -> None:
        """Run CRIU until it holds at post-dump; raises (the tree running) if it ends first."""
        self._thread.start()
        self._held.wait()
        if not self._reached:
            self._thread.join()
            self._ended = True
            if self._error is not None:
                raise self._error
            raise CriuFailed(f"CRIU dump of pid {self._job.pid} ended before its post-dump "
                             "notification", pid=self._job.pid)

    def finish(self) -> CriuDumpResult:
        if self._result is not None:
            return self._result
        if self._ended:
            raise CriuFailed(f"CRIU dump of pid {self._job.pid} was aborted", pid=self._job.pid)
        self._proceed = True
        self._decided.set()
        self._thread.join()
        self._ended = True
        if self._error is not None:
            raise self._error
        stats = read_dump_stats(self._job.work_dir)
        self._result = CriuDumpResult(
            frozen_s=(stats.frozen_time / 1e6) if stats else 0.0,
            freezing_s=(stats.freezing_time / 1e6) if stats else 0.0,
            pages_written=stats.pages_written if stats else 0,
            duration_s=time.monotonic() - self._started,
            pids=self._pids,
        )
        return self._result

    def abort(self) -> None:
        if self._ended:
            return
        self._proceed = False
        self._decided.set()
        self._thread.join()
        self._ended = True
        if self._error is not None and not isinstance(self._error.__cause__, _Abandoned):
            log.warning("CRIU dump of pid %d, abandoned: %s", self._job.pid, self._error)

    def _run(self) -> None:
        server = self._server
        try:
            if server is None:
                self._run_dump(self._job, _HoldAtPostDump(self._hooks, self), None)
            else:  # CRIU sends its pages to the server; its end is closed here once passed
                server.start()
                job = replace(self._job, page_server_fd=server.criu_end().fileno())
                self._run_dump(job, _HoldAtPostDump(self._hooks, self),
                               lambda _pid: server.close_criu_end())
        except BaseException as exc:
            self._error = exc
        finally:
            if server is not None:
                server.close_criu_end()
                server.abort()  # a no-op once the session is over
                with contextlib.suppress(PageServerError):
                    server.wait(10)
            self._held.set()

    def held_at_post_dump(self) -> None:
        """In CRIU's conversation: the images are complete (CRIU ended its page-server
        session before this notification: the sink has had every page); wait for the
        decision."""
        if self._server is not None:
            self._server.wait(60)
        self._pids = read_pstree(self._job.images_dir)
        self._tcp = read_tcp_connections(self._job.images_dir)
        self._reached = True
        self._held.set()
        self._decided.wait()
        if not self._proceed:
            raise _Abandoned("the dump was abandoned (a later step failed)")


class _HoldAtPostDump(ForwardingHooks):
    """The caller's hooks, plus: hold at post-dump (after the caller's ``post_dump``)."""

    def __init__(self, inner: CriuHooks, dump: SwrkDump) -> None:
        super().__init__(inner)
        self._dump = dump

    def post_dump(self, pid: int) -> None:
        super().post_dump(pid)
        self._dump.held_at_post_dump()
