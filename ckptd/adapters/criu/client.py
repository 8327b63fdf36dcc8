"""The thin ``criu swrk`` client: one request to one CRIU over a SOCK_SEQPACKET socketpair.

Like go-criu's ``doSwrk``: start ``criu swrk <fd>``, send the request, answer each NOTIFY by
calling the matching ``CriuHooks`` method, return CRIU's final response. What the request
says (plain, streamed, in a container) is built beside it (``variants``); CRIU's log is read
in ``logs``.

Invariants: CRIU runs in a new session (restored trees land there, not in the daemon's); a
hook that raises is answered with ``notify_success = false`` (CRIU aborts and undoes the
operation) and no later hook is called; every failure is ``CriuFailed`` with CRIU's errno,
message and the tail of its log, or ``CriuUnavailable`` when CRIU cannot start; CRIU has
exited when ``call`` returns or raises.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptd._gen.criu import rpc_pb2
from ckptd.adapters.criu.containers import Container
from ckptd.adapters.criu.logs import exited_silently, failure
from ckptd.core.ports import CriuHooks
from ckptd.errors import CriuFailed, CriuUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwrkCall:
    """One CRIU request and how to run it."""

    req: rpc_pb2.criu_req
    hooks: CriuHooks
    fds: tuple[int, ...]
    """Descriptors CRIU inherits (the ones ``req`` names)."""
    log_path: Path
    """CRIU's log as this process sees it (its stderr goes beside it, ``.stderr``)."""
    what: str
    """For messages: ``"dump of pid 42"``, ``"restore"``."""
    pid: int | None
    env: dict[str, str]
    started: Callable[[int], None] | None = None
    """Run with CRIU's pid before CRIU is sent the request; if it raises, CRIU is sent
    nothing and exits, and the error is raised as CriuFailed (its cause kept)."""
    container: Container | None = None
    """CRIU runs inside it (its namespaces and cgroups, loaded from the node with the
    preload)."""
    notified_pid: Callable[[int], int] | None = None
    """Maps the pids of CRIU's notifications to the daemon's."""

    def node_pid(self, pid: int) -> int:
        """A pid CRIU answered (a restored root's) as the daemon sees it."""
        return self.notified_pid(pid) if self.notified_pid is not None else pid


def call(criu_path: str, preload: Path | None, swrk: SwrkCall) -> rpc_pb2.criu_resp:
    """Run one CRIU (``criu_path``) for ``swrk``; its successful response."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stderr_path = swrk.log_path.with_suffix(".stderr")
    try:
        with open(stderr_path, "wb") as stderr:
            argv = [criu_path, "swrk", str(theirs.fileno())]
            entry: tuple[int, ...] = ()
            if swrk.container is not None:
                argv, entry = swrk.container.command(argv, preload=preload)
            try:
                proc = subprocess.Popen(
                    argv,
                    pass_fds=(theirs.fileno(), *swrk.fds, *entry),
                    stdin=subprocess.DEVNULL,
                    stdout=stderr,
                    stderr=stderr,
                    start_new_session=True,
                    env=swrk.env,
                )
            except OSError as exc:
                raise CriuUnavailable(f"cannot start {criu_path}: {exc}",
                                      pid=swrk.pid) from exc
        theirs.close()
        try:
            if swrk.started is not None:
                _run_started(swrk, proc.pid)
            resp = _converse(ours, swrk)
        finally:
            ours.close()
            proc.wait()
    finally:
        theirs.close()
    return resp


def _converse(sock: socket.socket, swrk: SwrkCall) -> rpc_pb2.criu_resp:
    table = _hook_table(swrk.hooks)
    sock.send(swrk.req.SerializeToString())
    hook_error: BaseException | None = None
    while True:
        resp = _receive(sock)
        if resp is None:
            raise exited_silently(swrk.what, swrk.log_path, swrk.pid)
        if resp.type != rpc_pb2.NOTIFY:
            break
        ok = True
        hook = table.get(resp.notify.script)
        if hook is not None and hook_error is None:
            try:
                hook(swrk.node_pid(resp.notify.pid))
            except Exception as exc:
                log.exception("hook %s failed", resp.notify.script)
                hook_error, ok = exc, False
        reply = rpc_pb2.criu_req(type=rpc_pb2.NOTIFY, notify_success=ok)
        sock.send(reply.SerializeToString())
    if resp.success and hook_error is None:
        return resp
    req = swrk.req
    error = failure(
        swrk.what, swrk.log_path, swrk.pid,
        errno=resp.cr_errno if resp.HasField("cr_errno") else None, errmsg=resp.cr_errmsg,
        hook_error=hook_error,
        ghost_limit=req.opts.ghost_limit if req.HasField("opts") else None,
    )
    if hook_error is not None:
        raise error from hook_error
    raise error


def _hook_table(hooks: CriuHooks) -> dict[str, Callable[[int], None]]:
    return {
        "pre-dump": hooks.pre_dump,
        "network-lock": hooks.network_lock,
        "post-dump": hooks.post_dump,
        "network-unlock": hooks.network_unlock,
        "pre-restore": hooks.pre_restore,
        "setup-namespaces": hooks.setup_namespaces,
        "post-restore": hooks.post_restore,
        "pre-resume": hooks.pre_resume,
        "post-resume": hooks.post_resume,
    }


def _run_started(swrk: SwrkCall, criu_pid: int) -> None:
    assert swrk.started is not None
    try:
        swrk.started(criu_pid)
    except Exception as exc:
        log.exception("hook criu_started failed")
        raise CriuFailed(f"CRIU {swrk.what} aborted before it began: {exc}",
                         log_path=str(swrk.log_path), pid=swrk.pid, hint="") from exc


def _receive(sock: socket.socket) -> rpc_pb2.criu_resp | None:
    """One whole message, sized with MSG_PEEK|MSG_TRUNC. None when CRIU has gone."""
    try:
        size = _peek_size(sock)
        if size == 0:
            return None
        data = sock.recv(size)
    except (ConnectionResetError, BrokenPipeError):
        return None
    resp = rpc_pb2.criu_resp()
    resp.ParseFromString(data)
    return resp


def _peek_size(sock: socket.socket) -> int:
    buf = bytearray(1)
    nbytes, _, flags, _ = sock.recvmsg_into([buf], 0, socket.MSG_PEEK | socket.MSG_TRUNC)
    del flags
    return nbytes


class DirFd:
    """A directory opened O_DIRECTORY for the lifetime of a ``with`` block."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY)
        return self.fd

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)
