"""ckptctl's argument types and parser: the edge's rules (``ckptd.transport.validate``) as
argparse types, and a parser whose every usage error is ONE line and exit code 2.

Invariants: a value that reaches a command handler passed the same rule the daemon applies
to the request field it becomes; a usage error prints ``ckptctl: <what>; see '<cmd> --help'``
and nothing else (no usage block, no second line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from ckptd.errors import BadRequest
from ckptd.transport import validate
from ckptd.transport.cli.output import EXIT_USAGE, CliError, err

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (its subparsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        err(f"{message}; see '{self.prog} --help'")
        sys.exit(EXIT_USAGE)


def checked(rule: Callable[[str], T]) -> Callable[[str], T]:
    """``rule`` as an argparse type: its BadRequest becomes argparse's one-line error."""

    def parse(text: str) -> T:
        try:
            return rule(text)
        except BadRequest as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    parse.__name__ = getattr(rule, "__name__", "value")
    return parse


def usage(exc: BadRequest) -> CliError:
    """A rule broken by a value checked after parsing: exit code 2, the rule's line."""
    return CliError(exc.message, EXIT_USAGE)


def _name(text: str) -> str:
    return validate.name(text, required=True)


def _pid(text: str) -> int:
    return validate.parse_pid(text)


def _label(text: str) -> tuple[str, str]:
    return validate.parse_label(text)


def _gpu_pair(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep:
        raise BadRequest(f"invalid --gpu-map {validate.shown(text)}: expected OLD=NEW",
                         field="gpu map")
    validate.gpu_map({old: new})
    return old, new


def _keep(text: str) -> int:
    return validate.parse_count(text, "--keep")


def _keep_last(text: str) -> int:
    return validate.parse_count(text, "--keep-last")


def _every(text: str) -> float:
    from ckptd.core.policies import MIN_EVERY_S  # the core's floor, said at the edge

    return validate.parse_duration(text, "--every period", minimum=MIN_EVERY_S)


def _timeout(text: str) -> float:
    return validate.parse_duration(text, "--timeout")


def _grace(text: str) -> float:
    return validate.parse_duration(text, "--grace", maximum=3600.0)


def _output(text: str) -> str:
    """An --output path, made absolute here (the daemon's working directory is /)."""
    validate.path(text or "/", "--output")  # control characters, length: before abspath
    return validate.path(os.path.abspath(text), "--output", required=True)


def _files_dir(text: str) -> str:
    """A --files directory, resolved here as the caller sees it (links included: the daemon
    follows none), the daemon's working directory being /."""
    validate.files_dirs([text if text.startswith("/") else "/" + text])  # characters, length
    return validate.files_dirs([os.path.realpath(text)])[0]


def _address(text: str) -> str:
    return validate.address(text, "--to address")


def _cgroup(text: str) -> str:
    return validate.cgroup(text, required=True)


def _checkpoint_id(text: str) -> str:
    return validate.checkpoint_id(text)


def _backlog(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 6:
        raise BadRequest(f"invalid --last {validate.shown(text)}: give a whole number",
                         field="backlog")
    return validate.backlog(int(text))


def _kind(text: str) -> str:
    return validate.kinds([text])[0]


name = checked(_name)
pid = checked(_pid)
label = checked(_label)
gpu_pair = checked(_gpu_pair)
keep = checked(_keep)
keep_last = checked(_keep_last)
every = checked(_every)
timeout = checked(_timeout)
grace = checked(_grace)
output = checked(_output)
files_dir = checked(_files_dir)
FILES_HELP = ("also capture every regular file under DIR with each checkpoint, open or not, "
              "and put it back at a restore (output directories of loggers that open, "
              "append and close per step); repeatable")
address = checked(_address)
cgroup = checked(_cgroup)
checkpoint_id = checked(_checkpoint_id)
backlog = checked(_backlog)
kind = checked(_kind)


def restore_target(text: str) -> str:
    """A checkpoint id or a pid (all digits), checked as the one it looks like."""
    if text.isascii() and text.isdigit():
        return str(pid(text))
    return checkpoint_id(text)
