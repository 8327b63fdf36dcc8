"""Issue 14: bad input, tried as a hostile or careless user with access to the socket would.

Over a hundred bad requests through ``ckptctl`` (its ``main``, in process: the code the
console script runs; a few through the real console script too) and through raw gRPC, against
one real daemon. For each: ONE line naming what was wrong, exit code 2 (CLI) or the right gRPC
code, the daemon still serving afterwards, and the target processes still running (never left
stopped or frozen). Rules behind the refusals: ``ckptd.transport.validate``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd._gen.ckptd.v1 import ckptd_pb2_grpc
from ckptd.transport.cli import main as cli

from .support import (
    Daemon,
    Procs,
    assert_ok,
    assert_one_line_error,
    free_pid,
    proc_state,
    run_ckptctl,
    workload,
)

pytestmark = pytest.mark.integration

UNKNOWN_ID = "ck-20000101T000000-abcdef"
PTRACE_SEIZE = 0x4206
SLEEPER = ("import threading, time; threading.Thread(target=time.sleep, args=(600,), "
           "daemon=True).start(); time.sleep(600)")


@dataclass
class Targets:
    """Processes the bad requests name; each must still run after every case."""

    job: int
    thread: int
    traced: int
    tracer: int
    free: int
    daemon: int
    checkpoint: str
    fifo: Path
    tmp: Path

    def assert_running(self) -> None:
        for pid in (self.job, self.traced):
            state = proc_state(pid)
            assert state is not None and state not in ("T", "t", "Z"), \
                f"pid {pid} is {state} after a bad request"


@pytest.fixture(scope="module")
def targets(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    procs = Procs()
    tmp = tmp_path_factory.mktemp("adversarial")
    try:
        job = procs.popen([sys.executable, "-c", SLEEPER], start_new_session=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        traced = procs.popen(["sleep", "600"], start_new_session=True)
        tracer = procs.popen([sys.executable, "-c", (
            "import ctypes, sys, time; libc = ctypes.CDLL(None, use_errno=True); "
            f"r = libc.ptrace({PTRACE_SEIZE}, {traced.pid}, None, None); "
            "print(r, flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
        assert tracer.stdout is not None and tracer.stdout.readline().strip() == "0"
        deadline = time.monotonic() + 5
        while len(os.listdir(f"/proc/{job.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        thread = max(int(t) for t in os.listdir(f"/proc/{job.pid}/task"))
        # a real checkpoint whose stdout (a pipe to us) needs an output file on restore
        counter = procs.popen(workload("counter", "--steps", 100000), start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert counter.stdout is not None
        counter.stdout.readline()
        ck = assert_ok(daemon.ctl("dump", counter.pid), "dump")
        counter.wait(timeout=10)  # reaped: a restore needs its pid free
        fifo = tmp / "fifo"
        os.mkfifo(fifo)
        yield Targets(job=job.pid, thread=thread, traced=traced.pid, tracer=tracer.pid,
                      free=free_pid(), daemon=daemon.pid, checkpoint=ck["id"], fifo=fifo,
                      tmp=tmp)
    finally:
        procs.cleanup()


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Iterator[Any]:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        yield ckptd_pb2_grpc.CheckpointerStub(channel)  # type: ignore[no-untyped-call]


def assert_serving(daemon: Daemon, stub: Any) -> None:
    assert daemon.proc.poll() is None, f"ckptd exited:\n{daemon.log()[-3000:]}"
    stub.List(pb.ListRequest(), timeout=10)


# ---- ckptctl ---------------------------------------------------------------------------------
# Each case: argv (``{job}``, ``{thread}``... filled from Targets) and what the line must say.

T = "{job}"
CLI_CASES: list[tuple[str, list[str], str]] = [
    ("dump-text-pid", ["dump", "abc"], "invalid pid 'abc'"),
    ("dump-pid-0", ["dump", "0"], "invalid pid 0"),
    ("dump-negative-pid", ["dump", "-1"], "-1"),
    ("dump-huge-pid", ["dump", "99999999999"], "invalid pid"),
    ("dump-free-pid", ["dump", "{free}"], "no process with pid"),
    ("dump-pid-1", ["dump", "1"], "pid 1 (init)"),
    ("dump-daemon", ["dump", "{daemon}"], "ckptd daemon"),
    ("dump-kthreadd", ["dump", "2"], "kernel thread"),
    ("dump-thread-id", ["dump", "{thread}"], "is a thread of process {job}"),
    ("dump-traced", ["dump", "{traced}"], "traced by PID {tracer} (strace/gdb?)"),
    ("dump-empty-name", ["dump", T, "--name", ""], "invalid name ''"),
    ("dump-newline-name", ["dump", T, "--name", "a\nb"], "invalid name"),
    ("dump-nul-name", ["dump", T, "--name", "a\0b"], "invalid name"),
    ("dump-10k-name", ["dump", T, "--name", "n" * 10240], "(10240 chars)"),
    ("dump-dotdot-name", ["dump", T, "--name", "/../x"], "invalid name '/../x'"),
    ("dump-space-name", ["dump", T, "--name", "my job"], "invalid name"),
    ("dump-huge-keep", ["dump", T, "--name", "a", "--keep", "99999999999"], "invalid --keep"),
    ("dump-negative-keep", ["dump", T, "--name", "a", "--keep", "-5"], "invalid --keep '-5'"),
    ("dump-zero-keep", ["dump", T, "--name", "a", "--keep", "0"], "invalid --keep '0'"),
    ("dump-text-keep", ["dump", T, "--name", "a", "--keep", "x"], "invalid --keep 'x'"),
    ("dump-keep-no-name", ["dump", T, "--keep", "3"], "--keep needs --name"),
    ("dump-label-novalue", ["dump", T, "--label", "novalue"], "KEY=VALUE"),
    ("dump-label-nokey", ["dump", T, "--label", "=x"], "invalid label key"),
    ("dump-label-newline", ["dump", T, "--label", "k=a\nb"], "control characters"),
    ("dump-cgroup-dotdot", ["dump", "--cgroup", "../x"], "invalid cgroup"),
    ("dump-cgroup-and-pid", ["dump", T, "--cgroup", "/x"], "not both"),
    ("dump-nothing", ["dump"], "give a pid"),
    ("dump-unknown-flag", ["dump", T, "--frobnicate"], "unrecognized arguments"),
    ("restore-text-id", ["restore", "abc"], "invalid checkpoint id 'abc'"),
    ("restore-path-id", ["restore", "ck-../../etc"], "invalid checkpoint id"),
    ("restore-unknown-id", ["restore", UNKNOWN_ID], UNKNOWN_ID),
    ("restore-pid-0", ["restore", "0"], "invalid pid 0"),
    ("restore-huge-pid", ["restore", "99999999999"], "invalid pid"),
    ("restore-empty-name", ["restore", "--name", ""], "invalid name ''"),
    ("restore-slash-name", ["restore", "--name", "a/b"], "invalid name"),
    ("restore-id-and-name", ["restore", UNKNOWN_ID, "--name", "a"], "not both"),
    ("restore-nothing", ["restore"], "give a checkpoint id"),
    ("restore-output-fifo", ["restore", "{checkpoint}", "--output", "{fifo}"],
     "FIFO with no reader"),
    ("restore-output-missing-dir", ["restore", "{checkpoint}", "--output",
                                    "{tmp}/nonexistent/dir/x"], "does not exist"),
    ("restore-output-directory", ["restore", "{checkpoint}", "--output", "{tmp}"],
     "is a directory"),
    ("restore-output-empty", ["restore", "{checkpoint}", "--output", ""], "--output"),
    ("restore-output-nul", ["restore", "{checkpoint}", "--output", "/tmp/a\0b"],
     "control characters"),
    ("restore-gpu-map-novalue", ["restore", UNKNOWN_ID, "--gpu-map", "x"], "OLD=NEW"),
    ("restore-gpu-map-space", ["restore", UNKNOWN_ID, "--gpu-map", "a=b c"], "GPU UUID"),
    ("list-text-pid", ["list", "--pid", "x"], "invalid pid 'x'"),
    ("list-pid-0", ["list", "--pid", "0"], "invalid pid 0"),
    ("list-space-name", ["list", "--name", "a b"], "invalid name"),
    ("show-bad-id", ["show", "x"], "invalid checkpoint id 'x'"),
    ("show-unknown-id", ["show", UNKNOWN_ID], UNKNOWN_ID),
    ("delete-bad-id", ["delete", "../x"], "invalid checkpoint id"),
    ("delete-unknown-id", ["delete", UNKNOWN_ID], UNKNOWN_ID),
    ("verify-bad-id", ["verify", "x\ny"], "invalid checkpoint id"),
    ("check-restore-bad-id", ["check-restore", "x"], "invalid checkpoint id"),
    ("check-restore-unknown", ["check-restore", UNKNOWN_ID], UNKNOWN_ID),
    ("gc-keep-last-0", ["gc", "--keep-last", "0"], "invalid --keep-last '0'"),
    ("gc-keep-last-negative", ["gc", "--keep-last", "-1"], "invalid --keep-last"),
    ("gc-keep-last-huge", ["gc", "--keep-last", "99999999999"], "invalid --keep-last"),
    ("gc-bad-name", ["gc", "--keep-last", "1", "--name", "a b"], "invalid name"),
    ("policy-every-nan", ["policy", "set", "job", "--every", "nan"], "invalid --every"),
    ("policy-every-inf", ["policy", "set", "job", "--every", "inf"], "invalid --every"),
    ("policy-every-absurd", ["policy", "set", "job", "--every", "100000000000h"], "at most"),
    ("policy-every-short", ["policy", "set", "job", "--every", "1s"], "at least 10s"),
    ("policy-every-negative", ["policy", "set", "job", "--every", "-5m"], "--every"),
    ("policy-every-exponent", ["policy", "set", "job", "--every", "3.6e14"], "invalid --every"),
    ("policy-pid-1", ["policy", "set", "1", "--name", "init", "--every", "1h"], "pid 1"),
    ("policy-daemon", ["policy", "set", "{daemon}", "--name", "d", "--every", "1h"],
     "ckptd daemon"),
    ("policy-thread", ["policy", "set", "{thread}", "--name", "t", "--every", "1h"],
     "is a thread"),
    ("policy-bad-name", ["policy", "set", "a b", "--every", "1h"], "invalid name"),
    ("policy-huge-keep", ["policy", "set", "job", "--keep", "99999999999"], "invalid --keep"),
    ("policy-pid-0", ["policy", "set", "job", "--pid", "0", "--every", "1h"], "invalid pid"),
    ("policy-pid-no-name", ["policy", "set", "123", "--every", "1h"], "needs --name"),
    ("policy-nothing", ["policy", "set", "job"], "give at least one"),
    ("policy-no-action", ["policy"], "required"),
    ("policy-clear-bad", ["policy", "clear", "a/b"], "invalid name"),
    ("policy-clear-unknown", ["policy", "clear", "nosuchjob"], "no policy for job"),
    ("policy-show-bad", ["policy", "show", "a b"], "invalid name"),
    ("migrate-port-99999", ["migrate", T, "--to", "node2:99999"], "port 99999 is out of range"),
    ("migrate-no-port", ["migrate", T, "--to", "node2"], "HOST:PORT"),
    ("migrate-space-host", ["migrate", T, "--to", "a b:80"], "HOST:PORT"),
    ("migrate-text-pid", ["migrate", "x", "--to", "a:1"], "invalid pid"),
    ("migrate-no-to", ["migrate", T], "--to"),
    ("drain-bad-name", ["drain", "--name", "a b"], "invalid name"),
    ("drain-unknown", ["drain", "--name", "nosuchjob"], "no running protected job named"),
    ("resume-bad-name", ["resume", "a/b"], "invalid name"),
    ("resume-unknown", ["resume", "nosuchjob"], "nosuchjob"),
    ("resume-nothing", ["resume"], "give a job name"),
    ("events-negative-last", ["events", "--last", "-1"], "invalid --last"),
    ("events-text-last", ["events", "--last", "x"], "invalid --last"),
    ("events-bad-kind", ["events", "--kind", "Bad Kind"], "invalid event kind"),
    ("timeout-nan", ["--timeout", "nan", "list"], "invalid --timeout"),
    ("timeout-negative", ["--timeout", "-1", "list"], "invalid --timeout"),
    ("timeout-zero", ["--timeout", "0", "list"], "invalid --timeout"),
    ("timeout-inf", ["list", "--timeout", "inf"], "invalid --timeout"),
    ("unknown-command", ["frobnicate"], "invalid choice"),
    ("no-command", [], "required"),
    ("run-every-nan", ["run", "--every", "nan", "--", "true"], "invalid --every"),
    ("run-keep-text", ["run", "--keep", "x", "--", "true"], "invalid --keep"),
    ("run-grace-negative", ["run", "--grace", "-1", "--", "true"], "invalid --grace"),
    ("run-bad-name", ["run", "--name", "a b", "--", "true"], "invalid name"),
]


def _fill(text: str, t: Targets) -> str:
    return text.format(job=t.job, thread=t.thread, traced=t.traced, tracer=t.tracer,
                       free=t.free, daemon=t.daemon, checkpoint=t.checkpoint, fifo=t.fifo,
                       tmp=t.tmp)


@pytest.mark.parametrize(("argv", "needle"), [(a, n) for _, a, n in CLI_CASES],
                         ids=[c for c, _, _ in CLI_CASES])
def test_ckptctl_refuses_in_one_line_with_exit_2(
    daemon: Daemon, stub: Any, targets: Targets, capsys: pytest.CaptureFixture[str],
    argv: list[str], needle: str,
) -> None:
    args = [_fill(a, targets) for a in argv]
    started = time.monotonic()
    code = cli.main(["--socket", str(daemon.socket), *args])
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}, stderr {err!r}"
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert lines[0].startswith("ckptctl: ") and len(lines[0]) < 400, lines[0]
    assert _fill(needle, targets).lower() in lines[0].lower(), lines[0]
    assert time.monotonic() - started < 10, "a bad request must be refused at once"
    targets.assert_running()
    assert_serving(daemon, stub)


def test_a_missing_output_directory_is_not_created(targets: Targets) -> None:
    assert not (targets.tmp / "nonexistent").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["dump", "--keep", "99999999999", "--name", "a", "1"], "invalid --keep"),
     (["list", "--pid", "x"], "invalid pid"),
     (["--timeout", "nan", "list"], "invalid --timeout"),
     (["migrate", "1", "--to", "x:99999"], "out of range")],
    ids=["keep", "pid", "timeout", "port"],
)
def test_the_console_script_says_the_same_one_line(daemon: Daemon, argv: list[str],
                                                  needle: str) -> None:
    assert_one_line_error(run_ckptctl(daemon.socket, *argv), 2, needle)


# ---- raw gRPC --------------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def _stream(call: Any) -> None:
    for _ in call:
        pass


GRPC_CASES: list[tuple[str, Callable[[Any, Targets], Any], grpc.StatusCode, str]] = [
    ("dump-pid-0", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=0))), INVALID, "pid"),
    ("dump-pid-negative", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=-5))), INVALID,
     "invalid pid -5"),
    ("dump-keep-negative", lambda s, t: _stream(s.Dump(pb.DumpRequest(
        pid=t.job, name="a", keep=-5))), INVALID, "keep all"),
    ("dump-keep-no-name", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=t.job, keep=2))),
     INVALID, "invalid name"),
    ("dump-newline-name", lambda s, t: _stream(s.Dump(pb.DumpRequest(
        pid=t.job, name="a\nb"))), INVALID, "invalid name"),
    ("dump-10k-name", lambda s, t: _stream(s.Dump(pb.DumpRequest(
        pid=t.job, name="x" * 10240))), INVALID, "(10240 chars)"),
    ("dump-many-labels", lambda s, t: _stream(s.Dump(pb.DumpRequest(
        pid=t.job, labels={f"k{i}": "v" for i in range(100)}))), INVALID, "too many label"),
    ("dump-cgroup-dotdot", lambda s, t: _stream(s.Dump(pb.DumpRequest(cgroup="/a/../b"))),
     INVALID, "invalid cgroup"),
    ("dump-pid-1", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=1))), INVALID, "pid 1"),
    ("dump-daemon", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=t.daemon))), INVALID,
     "ckptd daemon"),
    ("dump-thread", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=t.thread))), INVALID,
     "is a thread"),
    ("dump-traced", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=t.traced))), INVALID,
     "being traced"),
    ("dump-free", lambda s, t: _stream(s.Dump(pb.DumpRequest(pid=t.free))), NOT_FOUND,
     "no process"),
    ("restore-nothing", lambda s, t: _stream(s.Restore(pb.RestoreRequest())), INVALID,
     "give a checkpoint id"),
    ("restore-path-id", lambda s, t: _stream(s.Restore(pb.RestoreRequest(
        checkpoint_id="../../etc/passwd"))), INVALID, "invalid checkpoint id"),
    ("restore-pid-negative", lambda s, t: _stream(s.Restore(pb.RestoreRequest(pid=-1))),
     INVALID, "invalid pid"),
    ("restore-nul-name", lambda s, t: _stream(s.Restore(pb.RestoreRequest(name="a\0b"))),
     INVALID, "invalid name"),
    ("restore-relative-output", lambda s, t: _stream(s.Restore(pb.RestoreRequest(
        checkpoint_id=t.checkpoint, output_path="out.log"))), INVALID, "absolute"),
    ("restore-dotdot-output", lambda s, t: _stream(s.Restore(pb.RestoreRequest(
        checkpoint_id=t.checkpoint, output_path="/tmp/../etc/x"))), INVALID, "'..'"),
    ("restore-fifo-output", lambda s, t: _stream(s.Restore(pb.RestoreRequest(
        checkpoint_id=t.checkpoint, output_path=str(t.fifo)))), INVALID, "FIFO"),
    ("restore-bad-gpu-map", lambda s, t: _stream(s.Restore(pb.RestoreRequest(
        checkpoint_id=t.checkpoint, gpu_map={"a b": "c"}))), INVALID, "GPU UUID"),
    ("migrate-port-99999", lambda s, t: _stream(s.Migrate(pb.MigrateRequest(
        pid=t.job, to="node2:99999"))), INVALID, "out of range"),
    ("migrate-pid-0", lambda s, t: _stream(s.Migrate(pb.MigrateRequest(to="a:1"))), INVALID,
     "invalid pid"),
    ("get-empty", lambda s, t: s.Get(pb.GetRequest(id="")), INVALID, "checkpoint id"),
    ("get-bad", lambda s, t: s.Get(pb.GetRequest(id="../x")), INVALID, "checkpoint id"),
    ("get-unknown", lambda s, t: s.Get(pb.GetRequest(id=UNKNOWN_ID)), NOT_FOUND, UNKNOWN_ID),
    ("delete-bad", lambda s, t: s.Delete(pb.DeleteRequest(id="x\n")), INVALID,
     "checkpoint id"),
    ("verify-bad", lambda s, t: s.Verify(pb.VerifyRequest(id="x")), INVALID, "checkpoint id"),
    ("check-restore-bad", lambda s, t: s.CheckRestore(pb.CheckRestoreRequest(id="x")),
     INVALID, "checkpoint id"),
    ("gc-keep-negative", lambda s, t: s.Gc(pb.GcRequest(keep_last=-1)), INVALID, "keep-last"),
    ("gc-bad-name", lambda s, t: s.Gc(pb.GcRequest(name="\n")), INVALID, "invalid name"),
    ("list-pid-negative", lambda s, t: s.List(pb.ListRequest(pid=-1)), INVALID, "invalid pid"),
    ("list-bad-name", lambda s, t: s.List(pb.ListRequest(name="a b")), INVALID,
     "invalid name"),
    ("policy-nan", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", every_s=math.nan))), INVALID, "finite"),
    ("policy-inf", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", every_s=math.inf))), INVALID, "finite"),
    ("policy-absurd", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", every_s=3.6e14))), INVALID, "at most"),
    ("policy-keep-negative", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", keep=-5, on_term=True))), INVALID, "keep all"),
    ("policy-empty-name", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="", on_term=True))), INVALID, "invalid job name"),
    ("policy-pid-1", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", pid=1, on_term=True))), INVALID, "pid 1"),
    ("policy-daemon", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", pid=t.daemon, on_term=True))), INVALID, "ckptd daemon"),
    ("policy-pid-negative", lambda s, t: s.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(
        name="j", pid=-1, on_term=True))), INVALID, "invalid pid"),
    ("clear-empty", lambda s, t: s.ClearPolicy(pb.ClearPolicyRequest(name="")), INVALID,
     "invalid job name"),
    ("drain-bad", lambda s, t: s.Drain(pb.DrainRequest(names=["a b"])), INVALID,
     "invalid job name"),
    ("resume-bad", lambda s, t: s.Resume(pb.ResumeRequest(name="a\nb")), INVALID,
     "invalid job name"),
    ("watch-backlog", lambda s, t: _stream(s.Watch(pb.WatchRequest(backlog=10**9))),
     INVALID, "backlog"),
    ("watch-kind", lambda s, t: _stream(s.Watch(pb.WatchRequest(kinds=["A B"]))), INVALID,
     "event kind"),
    ("reserve-negative", lambda s, t: s.ReservePids(pb.ReservePidsRequest(above=-1)),
     INVALID, "invalid pid"),
    ("group-empty-id", lambda s, t: s.GroupPrepare(pb.GroupPrepareRequest(
        group_id="", pid=t.job)), INVALID, "group id"),
    ("group-nan-timeout", lambda s, t: s.GroupPrepare(pb.GroupPrepareRequest(
        group_id="g-1", pid=t.job, timeout_s=math.nan)), INVALID, "finite"),
    ("group-abort-bad-id", lambda s, t: s.GroupAbort(pb.GroupAbortRequest(group_id="a/b")),
     INVALID, "group id"),
]


@pytest.mark.parametrize(("call", "code", "needle"), [(c, k, n) for _, c, k, n in GRPC_CASES],
                         ids=[c for c, _, _, _ in GRPC_CASES])
def test_raw_grpc_refuses_with_the_right_code(
    daemon: Daemon, stub: Any, targets: Targets,
    call: Callable[[Any, Targets], Any], code: grpc.StatusCode, needle: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(stub, targets)
    err = info.value
    assert err.code() is code, f"{err.code()}: {err.details()}"
    details = err.details()
    assert "\n" not in details and len(details) < 400, details
    assert needle.lower() in details.lower(), details
    targets.assert_running()
    assert_serving(daemon, stub)


def test_nothing_was_checkpointed_or_changed(daemon: Daemon, targets: Targets) -> None:
    """After every bad request: no checkpoint of the targets, no policy, the job running."""
    for pid in (targets.job, targets.thread, targets.traced):
        assert daemon.checkpoints_of(pid) == []
    policies = assert_ok(daemon.ctl("policy", "show"), "policy show")
    assert policies == []
    targets.assert_running()
    assert len(CLI_CASES) + len(GRPC_CASES) >= 100

