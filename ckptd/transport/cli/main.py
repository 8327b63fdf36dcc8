"""``ckptctl``: the command-line client of ckptd.

Talks gRPC (``ckptd.v1.Checkpointer``) to the daemon over its Unix socket. Every command prints
a human summary by default, or one JSON document on stdout with ``--json``. A failure is one
line on stderr, ``ckptctl: <what went wrong; what to do>``, and a non-zero exit code:

====  =====================================================================================
0     success (``check`` exits 0 even when CRIU is unusable: it is a report)
1     other failures (the daemon failed, an internal error, a timeout); ``verify`` found
      damage; ``check-restore`` found differences
2     bad input: usage error, invalid pid, no such process / checkpoint, permission denied,
      the node cannot do it now (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
      FAILED_PRECONDITION)
3     the daemon cannot be reached (UNAVAILABLE)
4     busy: another operation holds the target (RESOURCE_EXHAUSTED, ABORTED)
130   interrupted (Ctrl-C)
====  =====================================================================================
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn, Protocol, TypeVar, cast

from ckptd.errors import BadRequest
from ckptd.transport.cli import args as types
from ckptd.transport.cli import jobs, lazy, render, run
from ckptd.transport.cli.completion import bash_completion
from ckptd.transport.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_BUSY,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    PROG,
    CliError,
)
from ckptd.transport.cli.output import err as _err
from ckptd.transport.cli.output import one_line as _one_line
from ckptd.transport.cli.output import out as _out
from ckptd.transport.cli.output import print_json as _print_json
from ckptd.transport.cli.output import stream_result as _stream_result

if TYPE_CHECKING:  # imported on first use (lazy.py): --help and usage errors need none of them
    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
    from ckptd.transport.cli import asides, convert, wire
else:
    wire = lazy.module("ckptd.transport.cli.wire")
    pb = lazy.module("ckptd._gen.ckptd.v1.ckptd_pb2")
    asides = lazy.module("ckptd.transport.cli.asides")
    convert = lazy.module("ckptd.transport.cli.convert")

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"
SOCKET_ENV = "CKPTD_SOCKET"
DEFAULT_TIMEOUT_S = 30.0

_EXIT_BY_CODE: dict[str, int] = {
    "INVALID_ARGUMENT": EXIT_USAGE,
    "NOT_FOUND": EXIT_USAGE,
    "PERMISSION_DENIED": EXIT_USAGE,
    "FAILED_PRECONDITION": EXIT_USAGE,
    "UNAVAILABLE": EXIT_UNAVAILABLE,
    "RESOURCE_EXHAUSTED": EXIT_BUSY,
    "ABORTED": EXIT_BUSY,
}
"""Exit codes by gRPC status name (``wire.StatusCode.X.name``; grpc is imported on use)."""

_T_co = TypeVar("_T_co", covariant=True)


# --------------------------------------------------------------------------------------------
# The gRPC stub, typed (the generated ``*_pb2_grpc`` module has no annotations).


class _StreamCall(Protocol[_T_co]):
    def __iter__(self) -> Iterator[_T_co]: ...

    def cancel(self) -> bool: ...


class CheckpointerClient(Protocol):
    def Dump(
        self, request: pb.DumpRequest, timeout: float | None = None
    ) -> _StreamCall[pb.DumpEvent]: ...

    def Restore(
        self, request: pb.RestoreRequest, timeout: float | None = None
    ) -> _StreamCall[pb.RestoreEvent]: ...

    def Migrate(
        self, request: pb.MigrateRequest, timeout: float | None = None
    ) -> _StreamCall[pb.MigrateEvent]: ...

    def List(self, request: pb.ListRequest, timeout: float | None = None) -> pb.ListResponse: ...

    def Watch(
        self, request: pb.WatchRequest, timeout: float | None = None
    ) -> _StreamCall[pb.Event]: ...

    def SetPolicy(self, request: pb.SetPolicyRequest, timeout: float | None = None
                  ) -> pb.Policy: ...

    def ListPolicies(self, request: pb.ListPoliciesRequest, timeout: float | None = None
                     ) -> pb.ListPoliciesResponse: ...

    def ClearPolicy(self, request: pb.ClearPolicyRequest, timeout: float | None = None
                    ) -> pb.ClearPolicyResponse: ...

    def Drain(self, request: pb.DrainRequest, timeout: float | None = None
              ) -> pb.DrainResponse: ...

    def Resume(self, request: pb.ResumeRequest, timeout: float | None = None
               ) -> pb.ResumeResponse: ...

    def Get(self, request: pb.GetRequest, timeout: float | None = None) -> pb.Checkpoint: ...

    def Delete(
        self, request: pb.DeleteRequest, timeout: float | None = None
    ) -> pb.DeleteResponse: ...

    def Check(self, request: pb.CheckRequest, timeout: float | None = None) -> pb.CheckResponse: ...

    def Verify(
        self, request: pb.VerifyRequest, timeout: float | None = None
    ) -> pb.VerifyResponse: ...

    def Gc(self, request: pb.GcRequest, timeout: float | None = None) -> pb.GcResponse: ...

    def CheckRestore(
        self, request: pb.CheckRestoreRequest, timeout: float | None = None
    ) -> pb.CheckRestoreResponse: ...


def _stub(channel: wire.Channel) -> CheckpointerClient:
    """The daemon's Checkpointer service on ``channel`` (``wire``: not grpcio, issue 35)."""
    service = pb.DESCRIPTOR.services_by_name["Checkpointer"]
    return cast(CheckpointerClient, wire.Stub(channel, service, pb))


class Context(NamedTuple):
    socket: str
    json: bool
    timeout: float | None
    client: CheckpointerClient


# --------------------------------------------------------------------------------------------
# Output helpers: looked up on ``sys`` at call time so that redirections (and pytest) apply.




# --------------------------------------------------------------------------------------------
# Argument types.


# --------------------------------------------------------------------------------------------
# Commands. Each takes the context and the parsed arguments and returns the exit code.


def cmd_dump(ctx: Context, args: argparse.Namespace) -> int:
    if args.cgroup and args.pid is not None:
        args.subparser.error("give a pid or --cgroup PATH, not both")
    if args.pid is None and not args.cgroup:
        if not args.name:
            args.subparser.error("give a pid, or --name NAME of a job ckptd protects")
        return jobs.dump_by_name(ctx, args.name, leave_running=args.leave_running,
                                 keep=args.keep or 0)
    pid: int = args.pid or 0
    labels = dict(args.label or [])
    if args.keep and not args.name:
        args.subparser.error("--keep needs --name (retention is per name)")
    request = pb.DumpRequest(
        pid=pid,
        leave_running=args.leave_running,
        name=args.name or "",
        labels=labels,
        keep=args.keep or 0,
        tcp_close=bool(args.tcp_close),
        cgroup=args.cgroup or "",
        files_dirs=args.files or [],
    )
    result = _stream_result(ctx.client.Dump(request, timeout=ctx.timeout), "checkpoint")
    if result is None:
        what = f"pid {pid}" if pid else f"cgroup {args.cgroup}"
        raise CliError(
            f"ckptd ended the dump of {what} without a result; check the daemon's log"
        )
    ck = convert.checkpoint_to_dict(cast(pb.Checkpoint, result))
    if ctx.json:
        _print_json(ck)
    else:
        _out(render.dump_summary(ck))
    return EXIT_OK


def cmd_restore(ctx: Context, args: argparse.Namespace) -> int:
    target: str | None = args.target
    if target is not None and args.name:
        args.subparser.error("give a checkpoint id or pid, or --name, not both")
    if target is None and not args.name:
        args.subparser.error("give a checkpoint id or pid, or --name NAME")
    output = args.output or ""
    gpu_map = dict(args.gpu_map or [])
    if target is None:
        request = pb.RestoreRequest(name=args.name, output_path=output)
        what = f"the latest checkpoint named {args.name!r}"
    elif target.isdigit():
        request = pb.RestoreRequest(pid=int(target), output_path=output)
        what = f"the latest checkpoint of pid {target}"
    else:
        request = pb.RestoreRequest(checkpoint_id=target, output_path=output)
        what = target
    request.gpu_map.update(gpu_map)
    request.ignore_warnings = bool(args.ignore_warnings)
    request.lazy = bool(args.lazy)
    result = _stream_result(ctx.client.Restore(request, timeout=ctx.timeout), "result")
    if result is None:
        raise CliError(f"ckptd ended the restore of {what} without a result; check its log")
    data = convert.restore_result_to_dict(cast(pb.RestoreResult, result))
    if ctx.json:
        _print_json(data)
    else:
        _out(render.restore_summary(data))
    return EXIT_OK


def cmd_migrate(ctx: Context, args: argparse.Namespace) -> int:
    pid: int = args.pid
    request = pb.MigrateRequest(
        pid=pid,
        to=args.to,
        name=args.name or "",
        labels=dict(args.label or []),
        output_path=args.output or "",
        ignore_warnings=bool(args.ignore_warnings),
    )
    result = _stream_result(ctx.client.Migrate(request, timeout=ctx.timeout), "result")
    if result is None:
        raise CliError(f"ckptd ended the migration of pid {pid} without a result; see its log")
    data = convert.message_to_dict(cast(pb.MigrateResult, result))
    if ctx.json:
        _print_json(data)
    else:
        _out(render.migrate_summary(data))
    return EXIT_OK


def cmd_list(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ListRequest(pid=args.pid or 0, name=args.name or "")
    checkpoints = convert.checkpoints_to_list(ctx.client.List(request, timeout=ctx.timeout))
    if ctx.json:
        _print_json(checkpoints)
    elif checkpoints:
        _out(render.checkpoint_table(checkpoints))
    else:
        _out("no checkpoints")
    return EXIT_OK


def cmd_show(ctx: Context, args: argparse.Namespace) -> int:
    ck = convert.checkpoint_to_dict(ctx.client.Get(pb.GetRequest(id=args.id), timeout=ctx.timeout))
    if ctx.json:
        _print_json(ck)
    else:
        _out(render.checkpoint_details(ck))
    return EXIT_OK


def cmd_check_restore(ctx: Context, args: argparse.Namespace) -> int:
    response = ctx.client.CheckRestore(
        pb.CheckRestoreRequest(id=args.id), timeout=ctx.timeout
    )
    report = convert.message_to_dict(response)
    if ctx.json:
        _print_json(report)
    else:
        _out(render.compat_report(report))
    return EXIT_OK if report["compatible"] else EXIT_FAILURE


def cmd_delete(ctx: Context, args: argparse.Namespace) -> int:
    response = ctx.client.Delete(pb.DeleteRequest(id=args.id), timeout=ctx.timeout)
    data = convert.delete_to_dict(response, args.id)
    if ctx.json:
        _print_json(data)
    else:
        _out(f"deleted {data['id']}")
    return EXIT_OK


def cmd_asides(ctx: Context, args: argparse.Namespace) -> int:
    return asides.run(ctx.client, args, ctx.json, ctx.timeout)


def cmd_check(ctx: Context, args: argparse.Namespace) -> int:
    report = convert.check_to_dict(ctx.client.Check(pb.CheckRequest(), timeout=ctx.timeout))
    if ctx.json:
        _print_json(report)
    else:
        _out(render.check_report(report))
    return EXIT_OK


def cmd_verify(ctx: Context, args: argparse.Namespace) -> int:
    report = convert.message_to_dict(
        ctx.client.Verify(pb.VerifyRequest(id=args.id or ""), timeout=ctx.timeout)
    )
    if ctx.json:
        _print_json(report)
    else:
        _out(render.verify_report(report))
    return EXIT_OK if report["ok"] else EXIT_FAILURE


def cmd_gc(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.GcRequest(keep_last=args.keep_last or 0, name=args.name or "",
                           no_compact=bool(args.no_compact))
    report = convert.message_to_dict(ctx.client.Gc(request, timeout=ctx.timeout))
    if ctx.json:
        _print_json(report)
    else:
        _out(render.gc_report(report))
    return EXIT_OK




# --------------------------------------------------------------------------------------------
# Parser.

Handler = Callable[[Context, argparse.Namespace], int]

_COMMANDS_TIMEOUT_NONE = frozenset({"dump", "restore", "migrate", "drain", "resume", "run"})


def _add_global_options(parser: argparse.ArgumentParser) -> None:
    """``--socket``, ``--json`` and ``--timeout``, accepted before and after the subcommand.

    Their default is SUPPRESS everywhere, so a subcommand's parser never overwrites a value
    given before the subcommand; defaults are resolved after parsing (:func:`_resolve`)."""
    group = parser.add_argument_group("global options")
    group.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=f"the daemon's Unix socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document on stdout instead of human output",
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=types.timeout,
        default=argparse.SUPPRESS,
        help=f"give up after SECONDS (default: none for dump and restore, "
        f"{DEFAULT_TIMEOUT_S:g} for the others)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = types.Parser(
        prog=PROG,
        description="Checkpoint and restore processes with ckptd.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    _add_global_options(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _add_global_options(sub)
        sub.set_defaults(handler=handler, subparser=sub)
        return sub

    _add_dump(command)
    _add_migrate(command)
    jobs.add_commands(command, _add_global_options)
    run.add_command(command)
    _add_restore(command)
    _add_checkpoint_commands(command)
    _add_gc(command)
    completion = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a shell completion script. Bash: "
        f'eval "$({PROG} completion bash)", or save it to '
        f"/etc/bash_completion.d/{PROG}.",
    )
    completion.add_argument("shell", choices=["bash"])
    completion.set_defaults(handler=None, subparser=completion)
    return parser


Command = Callable[[str, Handler, str], argparse.ArgumentParser]
"""``build_parser``'s ``command(name, handler, help)``: a subcommand with the global options."""


def _add_dump(command: Command) -> None:
    dump = command("dump", cmd_dump, "checkpoint a process tree")
    dump.add_argument(
        "pid", nargs="?", type=types.pid,
        help="the root process of the tree to checkpoint, or a container's init (its job "
        "is checkpointed); leave it out with --name NAME: the job of that name that ckptd "
        "protects, e.g. from a Kubernetes preStop hook",
    )
    dump.add_argument(
        "--cgroup", metavar="PATH", type=types.cgroup,
        help="instead of a pid: the container whose cgroup (v2 path, as /proc/PID/cgroup's "
        "0:: line says) this is; the job under its init is checkpointed",
    )
    dump.add_argument(
        "--leave-running",
        action="store_true",
        help="let the tree run on after the checkpoint (default: it is stopped)",
    )
    dump.add_argument(
        "--tcp-close",
        action="store_true",
        help="a restore brings the tree's TCP connections back closed, the application sees a "
        "reset (default: restored established where the node has each connection's local "
        "address, else closed; a daemon with tcp_outside_peers = \"refuse\" refuses "
        "connections to peers outside the tree without this)",
    )
    dump.add_argument("--name", metavar="NAME", type=types.name,
                      help="a name to find the checkpoint by")
    dump.add_argument(
        "--label",
        metavar="K=V",
        action="append",
        type=types.label,
        help="attach a label (repeatable)",
    )
    dump.add_argument(
        "--keep",
        metavar="N",
        type=types.keep,
        help="with --name: then keep only the N newest checkpoints of that name",
    )
    dump.add_argument("--files", metavar="DIR", action="append", type=types.files_dir,
                      help=types.FILES_HELP)


def _add_migrate(command: Command) -> None:
    migrate = command(
        "migrate", cmd_migrate,
        "move a running process tree to another node's ckptd (checkpoint here, send what it "
        "lacks, restore there; restored here again if that fails)",
    )
    migrate.add_argument("pid", type=types.pid, help="the root process of the tree to move")
    migrate.add_argument(
        "--to", metavar="HOST:PORT", required=True, type=types.address,
        help="the target daemon's peer listener (its peer_listen setting)",
    )
    migrate.add_argument("--name", metavar="NAME", type=types.name,
                         help="a name for the checkpoint")
    migrate.add_argument(
        "--label", metavar="K=V", action="append", type=types.label,
        help="attach a label (repeatable)",
    )
    migrate.add_argument(
        "--output", metavar="PATH", type=types.output,
        help="on the target: where stdout/stderr go when they cannot be restored",
    )
    migrate.add_argument(
        "--ignore-warnings", action="store_true",
        help="migrate despite compatibility warnings (never despite blocking differences)",
    )


def _add_restore(command: Command) -> None:
    restore = command("restore", cmd_restore, "restore a checkpoint")
    restore.add_argument(
        "target",
        nargs="?",
        metavar="CHECKPOINT-ID|PID",
        type=types.restore_target,
        help="a checkpoint id, or a pid (all digits) for its latest checkpoint",
    )
    restore.add_argument(
        "--name", metavar="NAME", type=types.name,
        help="restore the latest checkpoint with this name"
    )
    restore.add_argument(
        "--output",
        metavar="PATH",
        type=types.output,
        help="where the restored tree's stdout/stderr go when they cannot be restored "
        "(default: a file ckptd chooses)",
    )
    restore.add_argument(
        "--gpu-map",
        metavar="OLD=NEW",
        action="append",
        type=types.gpu_pair,
        help="restore the checkpoint's GPU OLD (UUID) onto this node's GPU NEW (repeat for "
        "every checkpointed GPU; default: the same GPUs, else free ones of the same model)",
    )
    restore.add_argument(
        "--ignore-warnings",
        action="store_true",
        help="restore despite compatibility warnings (other kernel, CRIU or libc; see "
        f"'{PROG} check-restore'); blocking differences are never overridden",
    )
    restore.add_argument(
        "--lazy",
        action="store_true",
        help="let the job run before its memory is back: each page comes from the store, "
        "verified, when first touched, the rest in the background (events restore.lazy_done "
        "or restore.lazy_failed; a page that cannot be served kills the job). CPU jobs, "
        "restored on the node",
    )


def _add_checkpoint_commands(command: Command) -> None:
    """list, show, check-restore, delete, asides, check, verify."""
    list_ = command("list", cmd_list, "list checkpoints")
    list_.add_argument("--pid", metavar="PID", type=types.pid, help="only this pid's")
    list_.add_argument("--name", metavar="NAME", type=types.name,
                       help="only those with this name")

    show = command("show", cmd_show, "show a checkpoint in detail")
    show.add_argument("id", metavar="CHECKPOINT-ID", type=types.checkpoint_id)

    check_restore = command(
        "check-restore",
        cmd_check_restore,
        "say whether this node can restore a checkpoint (exit 0 when compatible, else 1)",
    )
    check_restore.add_argument("id", metavar="CHECKPOINT-ID", type=types.checkpoint_id)

    delete = command("delete", cmd_delete, "delete a checkpoint")
    delete.add_argument("id", metavar="CHECKPOINT-ID", type=types.checkpoint_id)

    asides_ = command(
        "asides", cmd_asides,
        "list the copies restores kept aside of checkpointed files (--remove: remove them)")
    asides_.add_argument("id", metavar="CHECKPOINT-ID", type=types.checkpoint_id, nargs="?",
                         help="only this checkpoint's files (default: all the caller's)")
    asides_.add_argument("--remove", action="store_true", help="remove them")

    command("check", cmd_check, "report what this node can checkpoint (CRIU, kernel, GPUs)")

    verify = command(
        "verify", cmd_verify, "read back a checkpoint (or the whole store) and check every byte"
    )
    verify.add_argument("id", nargs="?", metavar="CHECKPOINT-ID", type=types.checkpoint_id,
                        help="default: everything")


def _add_gc(command: Command) -> None:
    gc = command(
        "gc",
        cmd_gc,
        "delete data no checkpoint needs (root): unreferenced data is condemned, and deleted "
        "by a later run once the daemon's gc_grace_s has passed",
    )
    gc.add_argument(
        "--keep-last",
        metavar="N",
        type=types.keep_last,
        help="first delete all but the N newest checkpoints of each name",
    )
    gc.add_argument("--name", metavar="NAME", type=types.name,
                    help="apply --keep-last to this name only")
    gc.add_argument("--no-compact", action="store_true",
                    help="only free what no checkpoint needs: do not rewrite packs mostly "
                    "garbage (that writes new packs first; a full store skips it anyway)")


# --------------------------------------------------------------------------------------------
# Entry point.


def _resolve_socket(args: argparse.Namespace) -> str:
    return getattr(args, "socket", None) or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def _resolve_timeout(args: argparse.Namespace) -> float | None:
    timeout: float | None = getattr(args, "timeout", None)
    if timeout is not None:
        return timeout
    return None if args.command in _COMMANDS_TIMEOUT_NONE else DEFAULT_TIMEOUT_S


_STILL_RUNNING = {"dump", "restore", "migrate", "drain", "resume"}
"""Commands whose operation goes on in the daemon when the client stops waiting."""


def _timed_out(args: argparse.Namespace, timeout: float) -> str:
    """What a client deadline means for ``args``'s command: its operation may go on."""
    command = args.command
    if command not in _STILL_RUNNING:
        return f"ckptd did not answer within {timeout:g}s; retry with a larger --timeout"
    waited = f"no answer from ckptd within --timeout {timeout:g}s"
    if command == "dump":
        pid = getattr(args, "pid", None)
        what = f"the dump of pid {pid}" if pid else "the dump"
        then = "" if args.leave_running else " (and then stop the job)"
        check = f"`{PROG} list --pid {pid}`" if pid else f"`{PROG} list`"
        return (f"{waited}: {what} goes on in the daemon and may still complete{then}; "
                f"check with {check} or `{PROG} events --kind checkpoint`")
    if command == "migrate":
        return (f"{waited}: the migration of pid {args.pid} goes on in the daemon and may "
                f"still complete; check with `{PROG} events` before retrying")
    return (f"{waited}: the {command} goes on in the daemon and may still complete; check "
            f"with `{PROG} events` (and `{PROG} list`) before retrying")


_CONNECTION_LOST = re.compile(
    r"socket closed|connection reset|broken pipe|goaway|connection aborted|stream removed",
    re.IGNORECASE)
"""What gRPC says when an established connection broke (the daemon killed or stopped mid-call);
never reaching it says ``failed to connect to all addresses``."""


def _went_away(args: argparse.Namespace | None, details: str) -> str:
    """What a connection lost during ``args``'s call means: an operation may have completed."""
    lost = f"ckptd went away during the {{}} (connection lost: {details})"
    command = args.command if args is not None else ""
    if command not in _STILL_RUNNING:
        return (f"{lost.format('request')}; check that it runs (`systemctl status ckptd`) "
                "and retry")
    assert args is not None
    pid = getattr(args, "pid", None)
    if command == "dump":
        what = f"dump of pid {pid}" if pid else "dump"
        check = f"`{PROG} list --pid {pid}`" if pid else f"`{PROG} list`"
        return (f"{lost.format(what)}; the checkpoint may have committed: run {check} to see "
                "before retrying")
    if command == "migrate":
        return (f"{lost.format(f'migration of pid {pid}')}; the checkpoint may have committed "
                f"and the job may run on the target: run `{PROG} list` (here and on the "
                "target) to see before retrying")
    return (f"{lost.format(command)}; it may have completed: run `{PROG} list` and "
            f"`{PROG} events` to see before retrying")


def _rpc_error(err: wire.RpcError, socket: str, timeout: float | None,
               args: argparse.Namespace | None = None, late: bool = False) -> int:
    from ckptd.transport.metadata import ERROR_KIND_KEY

    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = _one_line(str(details_fn() or "")) if callable(details_fn) else ""
    exit_code = _EXIT_BY_CODE.get(code.name, EXIT_FAILURE) if code is not None else EXIT_FAILURE
    meta_fn = getattr(err, "trailing_metadata", None)
    metadata = (meta_fn() or ()) if callable(meta_fn) else ()
    from_daemon = any(key == ERROR_KIND_KEY for key, _ in metadata)
    refused = ""
    if code == wire.StatusCode.UNAVAILABLE and not from_daemon:
        from ckptd.transport.grpc.refusal import refusal_of

        refused = refusal_of(socket)  # the relay's line: this uid is at its limit
    if code == wire.StatusCode.UNAVAILABLE and from_daemon:
        _err(details)  # the daemon could not reach another daemon (migration)
        exit_code = EXIT_FAILURE
    elif refused:
        _err(refused)
    elif code == wire.StatusCode.UNAVAILABLE and _CONNECTION_LOST.search(details):
        _err(_went_away(args, details))
    elif code == wire.StatusCode.UNAVAILABLE:
        if os.path.exists(socket) and not os.access(socket, os.R_OK | os.W_OK):
            _err(
                f"cannot reach ckptd at {socket}: permission denied on the socket "
                "(run as root or as a user allowed to use it)"
            )
        else:
            _err(
                f"cannot reach ckptd at {socket}: is the daemon running? "
                "(start it with 'ckptd' or 'systemctl start ckptd')"
            )
    elif timeout is not None and args is not None and (
            (code == wire.StatusCode.DEADLINE_EXCEEDED and not from_daemon) or late):
        _err(_timed_out(args, timeout))  # "Stream removed", "Deadline Exceeded": the client's
    elif code == wire.StatusCode.DEADLINE_EXCEEDED and details in ("", "Deadline Exceeded"):
        _err(f"ckptd did not answer within {timeout:g}s; retry with a larger --timeout")
    elif details:
        _err(details)
    else:
        name = code.name if code is not None else "UNKNOWN"
        _err(f"request failed ({name}) without a message; check the daemon's log")
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckptctl`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:  # usage error (2) or --help (0): argparse has printed it
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    if args.command == "completion":
        sys.stdout.write(bash_completion(parser))
        return EXIT_OK

    socket = _resolve_socket(args)
    timeout = _resolve_timeout(args)
    handler: Handler = args.handler
    started = time.monotonic()
    try:
        with wire.Channel(socket) as channel:
            ctx = Context(
                socket=socket,
                json=bool(getattr(args, "json", False)),
                timeout=timeout,
                client=_stub(channel),
            )
            return handler(ctx, args)
    except SystemExit as exc:  # a subparser's usage error found after parsing
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except wire.RpcError as err:
        late = timeout is not None and time.monotonic() - started >= timeout
        return _rpc_error(err, socket, timeout, args, late)
    except BadRequest as exc:  # a rule checked after parsing (the same as argparse's types)
        _err(exc.message)
        return EXIT_USAGE
    except CliError as err:
        _err(err.message)
        return err.exit_code
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if os.environ.get("CKPTCTL_DEBUG"):
            raise
        _err(
            f"internal error: {type(exc).__name__}: {exc}; "
            "rerun with CKPTCTL_DEBUG=1 for a traceback and report it"
        )
        return EXIT_FAILURE


def program() -> NoReturn:
    """The ``ckptctl`` program (console script, ``python -m ckptd.transport.cli``): :func:`main`,
    then its output flushed and the process ended at once.

    The interpreter's teardown after a command — gRPC's shutdown and ~300 modules' — took
    ~20 ms of a ~0.15 s small ``ckptctl dump`` (issue 25); nothing in it matters to a client
    whose channel is closed and output flushed. Where a thread other than the main one and
    daemon threads still runs (it would be waited for), or the flush fails, the ordinary exit
    is taken instead."""
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
    except (OSError, ValueError):
        sys.exit(code)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(code)
    os._exit(code)


def _silence_stdout() -> None:
    """After EPIPE on stdout, point it at /dev/null so that the interpreter's final flush
    does not print another error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    program()
