"""``ckptctl`` imports only what a command uses (issue 25, the small job: start-up is most of a
small ``ckptctl dump``). Each case runs the real CLI in a fresh interpreter and reads back the
modules it imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckptd.transport.cli import lazy

_PROBE = """
import json, sys
from ckptd.transport.cli.main import main
code = main(sys.argv[1:])
sys.stdout = sys.__stdout__
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

NEVER = ("ckptd.domain", "ckptd.core", "ckptd.adapters", "ckptd.daemon", "ckptd.testing",
         "ckptd.client", "google.protobuf.json_format", "grpc", "asyncio", "h2", "hpack",
         "hyperframe", "logging")
"""No command that talks to the daemon in one request needs these in the client: not even
grpcio (issue 35: ``ckptd.transport.cli.wire`` speaks gRPC itself, ~35 ms less start-up)."""
DAEMON = ("grpc", "ckptd.transport.cli.wire", "ckptd._gen", "google.protobuf")
"""What talking to the daemon needs; a command that does not talk to it imports none of it."""


def _imported(*argv: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True,
                          text=True, timeout=60, check=False)
    last = proc.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    return int(data["code"]), list(data["modules"])


def _under(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.mark.parametrize("argv", [["--help"], ["dump", "--help"], ["dump", "not-a-pid"],
                                  ["completion", "bash"]])
def test_no_daemon_no_grpc(argv: list[str]) -> None:
    """Help, a usage error and shell completion import neither gRPC nor the messages."""
    code, modules = _imported(*argv)
    assert code in (0, 2)
    assert _under(modules, DAEMON + NEVER) == []


@pytest.mark.parametrize("argv", [
    ["dump", "4242", "--leave-running", "--name", "job"],
    ["restore", "ck-20261122T110752-c586b0"],
    ["restore", "--name", "job"],
    ["list", "--pid", "4242"],
    ["delete", "ck-20261122T110752-c586b0"],
])
def test_commands_import_the_client_only(argv: list[str]) -> None:
    """dump, restore, list, delete reach the daemon (unreachable here: exit 3) with ckptctl's
    own gRPC client and the messages, and none of grpcio, logging or ckptd's domain, core,
    adapters or daemon."""
    code, modules = _imported("--socket", "/nonexistent/ckptd.sock", *argv)
    assert code == 3
    assert "ckptd.transport.cli.wire" in modules and "ckptd._gen.ckptd.v1.ckptd_pb2" in modules
    assert _under(modules, NEVER) == []


def test_a_lazy_module_imports_on_first_use_and_fails_there() -> None:
    missing = lazy.module("ckptd.no_such_module_for_this_test")
    assert "ckptd.no_such_module_for_this_test" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="no_such_module_for_this_test"):
        _ = missing.anything
    json_ = lazy.module("json")
    assert json_.dumps([1]) == "[1]"


def test_the_program_exits_at_once_with_all_its_output() -> None:
    """``program()`` ends the process without the interpreter's teardown: the output is whole
    (flushed first), the exit code main()'s."""
    import io
    from contextlib import redirect_stdout

    from ckptd.transport.cli.main import main

    expected = io.StringIO()
    with redirect_stdout(expected):
        assert main(["completion", "bash"]) == 0
    proc = subprocess.run([sys.executable, "-m", "ckptd.transport.cli", "completion", "bash"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0
    assert proc.stdout == expected.getvalue()
    assert len(proc.stdout) > 1000
    usage = subprocess.run([sys.executable, "-m", "ckptd.transport.cli", "dump", "x"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2
    assert "invalid" in usage.stderr
