"""What every ckptctl command shares: exit codes, the one-line error, output helpers.

Output goes through ``sys.stdout``/``sys.stderr`` looked up at call time, so that
redirections (and pytest) apply."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from ckptd.transport.cli import render

PROG = "ckptctl"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_BUSY = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `ckptctl list | head -0`


class CliError(Exception):
    """A failure to report as one line on stderr, with its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(f"{PROG}: {one_line(text)}\n")
    sys.stderr.flush()


def print_json(value: Any) -> None:
    out(json.dumps(value, indent=2, ensure_ascii=False))


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


class StreamCall(Protocol):
    def __iter__(self) -> Iterator[Any]: ...

    def cancel(self) -> bool: ...


def stream_result(call: StreamCall, result_field: str) -> Any:
    """Follow a Dump/Restore/Migrate stream: progress on a terminal's stderr, then its result."""
    progress = render.ProgressLine(sys.stderr)
    result: Any = None
    try:
        for event in call:
            kind = event.WhichOneof("event")
            if kind == "progress":
                p = event.progress
                progress.update(p.stage, p.message, p.fraction)
            elif kind == result_field:
                result = getattr(event, result_field)
    except KeyboardInterrupt:
        call.cancel()
        raise
    finally:
        progress.clear()
    return result
