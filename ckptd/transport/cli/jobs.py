"""ckptctl commands for jobs the daemon looks after: ``policy``, ``drain``, ``resume``,
``events``. Each takes the command context and the parsed arguments, returns the exit code."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptd.transport.cli import args as types
from ckptd.transport.cli import lazy, render
from ckptd.transport.cli.output import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    err,
    out,
    print_json,
    stream_result,
)

if TYPE_CHECKING:  # imported on first use (lazy.py): building the parser needs none of them
    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
    from ckptd.transport import validate
    from ckptd.transport.cli import convert
else:
    pb = lazy.module("ckptd._gen.ckptd.v1.ckptd_pb2")
    validate = lazy.module("ckptd.transport.validate")
    convert = lazy.module("ckptd.transport.cli.convert")

Command = Callable[[str, Callable[[Any, argparse.Namespace], int], str], argparse.ArgumentParser]


def policy_to_dict(p: pb.Policy) -> dict[str, Any]:
    return convert.message_to_dict(p)


def policy_line(p: dict[str, Any]) -> list[str]:
    def when(t: float) -> str:
        if not t:
            return "-"
        return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")

    return [
        p["name"], str(p["pid"] or "-"), render.seconds(p["every_s"]) + "s" if p["every_s"]
        else "-", str(p["keep"] or "-"), render.yes_no(p["on_term"]), when(p["last_fired"]),
        (p["drained_checkpoint_id"] and f"drained as {p['drained_checkpoint_id']}")
        or (p["last_error"] and f"error: {p['last_error']}") or "-",
    ]


def dump_by_name(ctx: Any, name: str, *, leave_running: bool, keep: int) -> int:
    """``ckptctl dump --name N`` without a pid: the protected job N. Without --leave-running
    it is drained (checkpointed, stopped, and remembered: ``ckptctl resume N``); with it, a
    plain leave-running checkpoint of its pid."""
    response = ctx.client.ListPolicies(pb.ListPoliciesRequest(), timeout=ctx.timeout)
    found = [p for p in response.policies if p.name == name]
    if not found or not found[0].pid:
        raise CliError(f"no job named {name!r} is protected here; start it with "
                       "`ckptctl run --name NAME -- ...` or give its pid", EXIT_USAGE)
    policy = found[0]
    if policy.drained_checkpoint_id:
        result = {"name": name, "id": policy.drained_checkpoint_id, "drained": True}
        if ctx.json:
            print_json(result)
        else:
            out(f"{name} is already checkpointed and stopped as {policy.drained_checkpoint_id}")
        return EXIT_OK
    if leave_running:
        call = ctx.client.Dump(pb.DumpRequest(pid=policy.pid, leave_running=True, name=name,
                                              keep=keep or policy.keep,
                                              files_dirs=policy.files_dirs),
                               timeout=ctx.timeout)
        ck = stream_result(call, "checkpoint")
        if ck is None:
            raise CliError(f"ckptd ended the checkpoint of {name} without a result")
        data = convert.checkpoint_to_dict(ck)
        if ctx.json:
            print_json(data)
        else:
            out(render.dump_summary(data))
        return EXIT_OK
    response = ctx.client.Drain(pb.DrainRequest(names=[name]), timeout=ctx.timeout)
    if response.errors:
        raise CliError(response.errors[0])
    ck_id = response.drained[0].drained_checkpoint_id
    if ctx.json:
        print_json({"name": name, "id": ck_id, "drained": True})
    else:
        out(f"checkpointed {name} (pid {policy.pid}) as {ck_id} and stopped it; "
            f"`ckptctl resume {name}` restores it")
    return EXIT_OK


def cmd_policy_set(ctx: Any, args: argparse.Namespace) -> int:
    if not (args.every or args.keep or args.on_term or args.files):
        args.subparser.error("give at least one of --every, --keep, --on-term, --files")
    if args.target.isascii() and args.target.isdigit():
        if not args.name:
            args.subparser.error("a pid needs --name NAME (the name its checkpoints get)")
        pid, name = validate.parse_pid(args.target), args.name
    else:
        pid, name = args.pid or 0, validate.name(args.target, required=True)
    policy = pb.Policy(name=name, pid=pid, every_s=args.every or 0.0, keep=args.keep or 0,
                       on_term=bool(args.on_term), files_dirs=args.files or [])
    result = policy_to_dict(ctx.client.SetPolicy(pb.SetPolicyRequest(policy=policy),
                                                 timeout=ctx.timeout))
    if ctx.json:
        print_json(result)
    else:
        out(f"policy of {result['name']}: " + ", ".join(
            x for x in (
                f"pid {result['pid']}" if result["pid"] else "",
                f"every {render.seconds(result['every_s'])}s" if result["every_s"] else "",
                f"keep {result['keep']}" if result["keep"] else "",
                "checkpointed on drain, spot notice and termination" if result["on_term"]
                else "",
            ) if x))
    return EXIT_OK


def cmd_policy_show(ctx: Any, args: argparse.Namespace) -> int:
    response = ctx.client.ListPolicies(pb.ListPoliciesRequest(), timeout=ctx.timeout)
    policies = [policy_to_dict(p) for p in response.policies
                if not args.name or p.name == args.name]
    if ctx.json:
        print_json(policies)
    elif policies:
        out(render.table(["NAME", "PID", "EVERY", "KEEP", "PROTECTED", "LAST", "STATE"],
                         [policy_line(p) for p in policies]))
    else:
        out("no policies")
    return EXIT_OK


def cmd_policy_clear(ctx: Any, args: argparse.Namespace) -> int:
    ctx.client.ClearPolicy(pb.ClearPolicyRequest(name=args.name), timeout=ctx.timeout)
    if ctx.json:
        print_json({"name": args.name})
    else:
        out(f"policy of {args.name} cleared")
    return EXIT_OK


def cmd_drain(ctx: Any, args: argparse.Namespace) -> int:
    response = ctx.client.Drain(pb.DrainRequest(names=args.name or []), timeout=ctx.timeout)
    drained = [policy_to_dict(p) for p in response.drained]
    if ctx.json:
        print_json({"drained": drained, "errors": list(response.errors)})
    else:
        for p in drained:
            out(f"drained {p['name']} (pid {p['pid']}) as {p['drained_checkpoint_id']}")
        if not drained and not response.errors:
            out("no protected job running here")
    for line in response.errors:
        err(f"not drained, still running: {line}")
    return EXIT_FAILURE if response.errors else EXIT_OK


def cmd_resume(ctx: Any, args: argparse.Namespace) -> int:
    if bool(args.all) == bool(args.name):
        args.subparser.error("give a job name, or --all")
    response = ctx.client.Resume(pb.ResumeRequest(name=args.name or "", all=bool(args.all)),
                                 timeout=ctx.timeout)
    restored = [convert.restore_result_to_dict(r) for r in response.restored]
    if ctx.json:
        print_json({"restored": restored, "errors": list(response.errors)})
    else:
        for r in restored:
            out(render.restore_summary(r))
        if not restored and not response.errors:
            out("no drained job to resume")
    for line in response.errors:
        err(f"not resumed: {line}")
    return EXIT_FAILURE if response.errors else EXIT_OK


def _message_to_dict(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    result: dict[str, Any] = MessageToDict(message)
    return result


def event_to_dict(e: pb.Event) -> dict[str, Any]:
    return {
        "seq": e.seq, "time": e.time, "kind": e.kind, "pid": e.pid,
        "checkpoint_id": e.checkpoint_id, "name": e.name, "message": e.message,
        "fields": _message_to_dict(e.fields),
    }


def event_line(e: dict[str, Any]) -> str:
    when = _dt.datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S")
    who = " ".join(x for x in (e["name"], f"pid {e['pid']}" if e["pid"] else "",
                               e["checkpoint_id"]) if x)
    message = render.escaped(e["message"])  # it may name files: never a raw newline
    return f"{when} {e['kind']:<22} {who}: {message}" if who else \
        f"{when} {e['kind']:<22} {message}"


def cmd_events(ctx: Any, args: argparse.Namespace) -> int:
    request = pb.WatchRequest(follow=bool(args.follow), backlog=args.last,
                              kinds=args.kind or [])
    call = ctx.client.Watch(request, timeout=None if args.follow else ctx.timeout)
    try:
        for e in call:
            data = event_to_dict(e)
            if ctx.json:
                out(json.dumps(data, ensure_ascii=False))
            else:
                out(event_line(data))
    except KeyboardInterrupt:
        call.cancel()
    return EXIT_OK


def add_commands(
    command: Command, global_options: Callable[[argparse.ArgumentParser], None]
) -> None:
    policy = command("policy", _usage, "periodic and on-termination checkpoints of a job")
    sub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)

    def action(name: str, handler: Callable[[Any, argparse.Namespace], int], text: str
               ) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=text, description=text)
        global_options(parser)
        parser.set_defaults(handler=handler, subparser=parser)
        return parser

    pset = action("set", cmd_policy_set, "set the policy of a job (by name, or a pid + --name)")
    pset.add_argument("target", metavar="NAME|PID")
    pset.add_argument("--name", metavar="NAME", type=types.name,
                      help="with a pid: the job's name")
    pset.add_argument("--pid", type=types.pid, help="with a name: the job's root process")
    pset.add_argument("--every", metavar="DURATION", type=types.every,
                      help="take a leave-running (incremental) checkpoint this often: 15m, 1h")
    pset.add_argument("--keep", metavar="N", type=types.keep,
                      help="keep the newest N checkpoints")
    pset.add_argument("--files", metavar="DIR", action="append", type=types.files_dir,
                      help=types.FILES_HELP)
    pset.add_argument("--on-term", action="store_true",
                      help="protect it: checkpoint it on drain, spot notice and termination")
    pshow = action("show", cmd_policy_show, "show policies (yours; every one for root)")
    pshow.add_argument("name", nargs="?", type=types.name)
    pclear = action("clear", cmd_policy_clear, "remove the policy of a job")
    pclear.add_argument("name", type=types.name)

    drain = command("drain", cmd_drain,
                    "checkpoint and stop every protected job on this node (maintenance)")
    drain.add_argument("--name", action="append", metavar="NAME", type=types.name,
                       help="only this job (repeatable; a user may drain their own jobs)")
    resume = command("resume", cmd_resume,
                     "restore jobs a drain or spot notice stopped, or one that died under "
                     "`ckptctl run` (its newest checkpoint)")
    resume.add_argument("name", nargs="?", type=types.name)
    resume.add_argument("--all", action="store_true", help="every drained job")

    events = command("events", cmd_events,
                     "what the daemon did: checkpoints, restores, policies, notices")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new ones")
    events.add_argument("--last", type=types.backlog, default=20, metavar="N",
                        help="start with the last N events (default 20)")
    events.add_argument("--kind", action="append", metavar="KIND", type=types.kind,
                        help="only this kind, e.g. checkpoint or policy.fired (repeatable)")


def _usage(ctx: Any, args: argparse.Namespace) -> int:
    del ctx
    args.subparser.print_usage()
    raise CliError("give an action", EXIT_USAGE)
