"""What every ckptctl command shares: exit codes, the one-line error, output helpers.

Output goes through ``sys.stdout``/``sys.stderr`` looked up at call time, so that
redirections (and pytest) apply."""

from __future__ import annotations

import json
import sys
from typing import Any

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
