"""Issue 14, the edge: one set of input rules (``ckptd.transport.validate``) behind the CLI and
the gRPC servicer; targets no dump or policy may name (a thread, a traced process, pid 1, the
daemon); CRIU's failures told as causes; per-uid limits on calls and operations."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.adapters.criu.causes import explain
from ckptd.core.events import EventBus
from ckptd.core.policies import PolicyService
from ckptd.domain import Caller, DumpRequest
from ckptd.domain.model import ROOT
from ckptd.errors import BadRequest, InvalidTarget, TargetRefused, TooManyRequests
from ckptd.testing import FakeClock, FakeProcessTable, MemoryPolicyRepo
from ckptd.transport import validate as v
from ckptd.transport.grpc import convert
from ckptd.transport.grpc.limits import CallLimits, Limits

from .world import DAEMON_PID, JOB, USER, World

# ---- the rules -------------------------------------------------------------------------------

BAD: list[tuple[str, Callable[[], Any], str]] = [
    ("empty name", lambda: v.name("", required=True), "invalid name ''"),
    ("10 KB name", lambda: v.name("a" * 10240), "(10240 chars)"),
    ("NUL in name", lambda: v.name("a\0b"), "invalid name"),
    ("newline in name", lambda: v.name("a\nb"), "invalid name"),
    ("path in name", lambda: v.name("/../etc"), "invalid name"),
    ("dot-dot name", lambda: v.name(".."), "invalid name"),
    ("bad id", lambda: v.checkpoint_id("ck-../../x"), "invalid checkpoint id"),
    ("empty id", lambda: v.checkpoint_id(""), "invalid checkpoint id"),
    ("pid 0", lambda: v.pid(0), "invalid pid 0"),
    ("pid -1", lambda: v.pid(-1), "invalid pid -1"),
    ("pid 2**31", lambda: v.pid(2**31), "invalid pid"),
    ("pid text", lambda: v.parse_pid("12a"), "invalid pid '12a'"),
    ("huge keep", lambda: v.parse_count("99999999999"), "invalid keep '99999999999'"),
    ("5000-digit keep", lambda: v.parse_count("9" * 5000), "(5000 chars)"),
    ("keep -5", lambda: v.count(-5), "(0: keep all)"),
    ("keep 0 typed", lambda: v.parse_count("0"), "invalid keep '0'"),
    ("NaN period", lambda: v.duration(math.nan), "finite"),
    ("inf period", lambda: v.duration(math.inf), "finite"),
    ("negative period", lambda: v.duration(-1.0), "positive"),
    ("3.6e14 s", lambda: v.duration(3.6e14), "at most"),
    ("nan typed", lambda: v.parse_duration("nan"), "use e.g. 30s"),
    ("1e400 typed", lambda: v.parse_duration("1" + "0" * 400), "invalid period"),
    ("port 99999", lambda: v.address("node2:99999"), "out of range"),
    ("port 0", lambda: v.address("node2:0"), "out of range"),
    ("no port", lambda: v.address("node2"), "HOST:PORT"),
    ("space host", lambda: v.address("a b:80"), "HOST:PORT"),
    ("relative output", lambda: v.path("out.log"), "absolute"),
    ("dot-dot output", lambda: v.path("/tmp/../etc/x"), "'..'"),
    ("NUL output", lambda: v.path("/tmp/a\0b"), "control characters"),
    ("directory output", lambda: v.path("/tmp/"), "directory"),
    ("long output", lambda: v.path("/" + "a" * 5000), "at most"),
    ("bad cgroup", lambda: v.cgroup("../x", required=True), "invalid cgroup"),
    ("label newline", lambda: v.labels({"k": "a\nb"}), "control characters"),
    ("label key", lambda: v.labels({"": "x"}), "invalid label key"),
    ("many labels", lambda: v.labels({f"k{i}": "" for i in range(65)}), "too many"),
    ("bad gpu", lambda: v.gpu_map({"GPU-1": "x y"}), "GPU UUID"),
    ("bad kind", lambda: v.kinds(["Checkpoint\n"]), "event kind"),
    ("backlog", lambda: v.backlog(10**9), "backlog"),
    ("relative --files", lambda: v.files_dirs(["out"]), "absolute"),
    ("dot-dot --files", lambda: v.files_dirs(["/tmp/../etc"]), "'..'"),
    ("root --files", lambda: v.files_dirs(["/"]), "not /"),
    ("17 --files", lambda: v.files_dirs([f"/d{i}" for i in range(17)]), "at most 16"),
]


@pytest.mark.parametrize(("fn", "needle"), [(f, n) for _, f, n in BAD], ids=[c for c, _, _ in BAD])
def test_a_bad_value_is_one_short_line_naming_it(fn: Callable[[], Any], needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        fn()
    text = str(info.value)
    assert needle in text
    assert "\n" not in text and "\0" not in text
    assert len(text) < 300, text


def test_good_values_pass_unchanged() -> None:
    assert v.name("train-1.a:b@c+d") == "train-1.a:b@c+d"
    assert v.count(0) == 0 and v.count(5) == 5
    assert v.parse_duration("15m") == 900.0
    assert v.address("node2:7411") == "node2:7411"
    assert v.address("[::1]:7411") == "[::1]:7411"
    assert v.address(":0", listen=True) == ":0"
    assert v.path("/tmp/x.out") == "/tmp/x.out"
    assert v.files_dirs(["/runs//a/", "/runs/a", "/b"]) == ("/runs/a", "/b")
    assert v.checkpoint_id("ck-20250101T120000-abcdef") == "ck-20250101T120000-abcdef"


@pytest.mark.parametrize(
    ("msg", "needle"),
    [
        (pb.DumpRequest(pid=42, name="a", keep=-5), "(0: keep all)"),
        (pb.DumpRequest(pid=42, keep=3), "invalid name ''"),
        (pb.DumpRequest(pid=42, name="a\nb"), "invalid name"),
        (pb.DumpRequest(pid=-3), "invalid pid -3"),
        (pb.DumpRequest(pid=42, cgroup="/x"), "not both"),
        (pb.DumpRequest(pid=42, files_dirs=["rel/dir"]), "absolute"),
    ],
)
def test_the_grpc_edge_applies_the_same_rules(msg: pb.DumpRequest, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle.replace("(", r"\(").replace(")", r"\)")):
        convert.dump_request(msg)


def test_a_policy_with_nan_or_absurd_period_is_refused_at_the_grpc_edge() -> None:
    for every in (math.nan, math.inf, 3.6e14, -60.0, 1.0):
        with pytest.raises(BadRequest):
            convert.policy_from(pb.Policy(name="job", every_s=every))
    assert convert.policy_from(pb.Policy(name="job", every_s=60.0)).every_s == 60.0


def test_a_restore_without_target_or_with_a_relative_output_is_refused() -> None:
    with pytest.raises(BadRequest, match="give a checkpoint id"):
        convert.restore_request(pb.RestoreRequest())
    with pytest.raises(BadRequest, match="absolute"):
        convert.restore_request(pb.RestoreRequest(pid=4, output_path="x.log"))
    with pytest.raises(BadRequest, match="out of range"):
        convert.migrate_request(pb.MigrateRequest(pid=4, to="node2:99999"))


# ---- targets ---------------------------------------------------------------------------------


def test_a_thread_id_is_refused_naming_its_process(world: World) -> None:
    thread = world.processes.add_process(JOB + 50, JOB, comm="job", uid=USER.uid)
    thread.tgid = JOB
    with pytest.raises(InvalidTarget) as info:
        world.dump(JOB + 50)
    assert f"pid {JOB + 50} is a thread of process {JOB}" in str(info.value)
    assert f"name the process: {JOB}" in str(info.value)
    assert world.criu.calls == [] if hasattr(world.criu, "calls") else True


def test_a_traced_process_is_refused_naming_its_tracer(world: World) -> None:
    world.processes.processes[JOB].tracer = 777
    with pytest.raises(TargetRefused) as info:
        world.dump(JOB)
    assert str(info.value) == (f"pid {JOB} is being traced by PID 777 (strace/gdb?); "
                               "detach the tracer and retry")


def _policies(processes: FakeProcessTable) -> PolicyService:
    clock = FakeClock()

    def dump(caller: Caller, request: DumpRequest) -> Any:
        raise AssertionError("no dump expected")

    return PolicyService(dump=dump, restore=lambda *a: None,  # type: ignore[arg-type]
                         repo=MemoryPolicyRepo(), processes=processes, clock=clock,
                         events=EventBus(clock), daemon_pid=DAEMON_PID)


@pytest.mark.parametrize("pid", [1, DAEMON_PID])
def test_policies_are_refused_on_pid_1_and_on_the_daemon(world: World, pid: int) -> None:
    from ckptd.domain import Policy

    with pytest.raises(TargetRefused):
        _policies(world.processes).set(ROOT, Policy(name="x", pid=pid, every_s=60.0))


# ---- CRIU's failures as causes ---------------------------------------------------------------


def test_criu_causes(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tjob\nTracerPid:\t9001\n")
    traced = explain("dump of pid 42", "Error (compel/src/lib/infect.c:1): SEIZE 42: task "
                     "not stopped after seize", 42, tmp_path)
    assert traced is not None
    assert "pid 42 is being traced by PID 9001 (strace/gdb?)" in traced.message
    assert traced.hint == "detach the tracer and retry"
    detach = explain("dump of pid 43", "Unable to detach 43: No such process", 43, tmp_path)
    assert detach is not None and "could not be seized" in detach.message
    ext = explain("dump of pid 5", "unix: External socket is used. Consider using "
                  "--ext-unix-sk option.", 5, tmp_path)
    assert ext is not None and "Unix socket connected to a process outside" in ext.message
    caps = explain("dump of pid 5", "CRIU needs to have the CAP_SYS_ADMIN or the "
                   "CAP_CHECKPOINT_RESTORE capability", 5, tmp_path)
    assert caps is not None and "capabilities" in caps.message
    assert explain("dump of pid 5", "Error (x): something else", 5, tmp_path) is None


# ---- per-uid limits --------------------------------------------------------------------------


def test_a_user_is_limited_and_root_never_is() -> None:
    limits = CallLimits(Limits(per_uid=2, operations_per_uid=1, shared=3))
    user, other = Caller(uid=1000), Caller(uid=2000)
    with limits.call(user), limits.call(user):
        with pytest.raises(TooManyRequests, match="uid 1000"), limits.call(user):
            pass
        with limits.call(other):
            with pytest.raises(TooManyRequests, match="max_user_calls"), limits.call(
                Caller(uid=3000)
            ):
                pass
            with limits.call(ROOT), limits.call(ROOT), limits.call(ROOT), limits.call(ROOT):
                pass  # root is never refused
    assert limits.calls() == {}
    with limits.operation(user, "dump"), pytest.raises(
        TooManyRequests, match="max_operations_per_uid"
    ), limits.operation(user, "dump"):
        pass
    with limits.operation(user, "dump"):
        pass  # released


def test_open_streams_have_slots_of_their_own() -> None:
    """Issue 21 (10): long-lived streams never take a call slot; their own bound per uid and
    for all users; root is never refused."""
    limits = CallLimits(Limits(per_uid=1, shared=1, open_streams_per_uid=2,
                               shared_open_streams=3))
    user, other = Caller(uid=1000), Caller(uid=2000)
    with limits.open_stream(user), limits.open_stream(user):
        with pytest.raises(TooManyRequests, match=r"max_open_streams_per_uid 2\)"), \
                limits.open_stream(user):
            pass
        with limits.call(user):  # the user's own call is served beside its streams
            assert limits.calls() == {1000: 1}
        with limits.open_stream(other):
            with pytest.raises(TooManyRequests, match="max_user_open_streams 3"), \
                    limits.open_stream(Caller(uid=3000)):
                pass
            with limits.open_stream(ROOT), limits.open_stream(ROOT), limits.open_stream(ROOT):
                pass
        assert limits.open_streams() == {1000: 2}
    assert limits.open_streams() == {}


# ---- the daemon's own settings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--peer-listen", "0.0.0.0:99999"], "port 99999 is out of range"),
        (["--metrics-listen", "localhost"], "HOST:PORT"),
    ],
)
def test_a_bad_listen_address_is_a_bad_configuration(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptd.daemon.main import main

    assert main(["--store", "/nonexistent-ckptd-store", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("gpu_lock_timeout_ms = -1", "gpu_lock_timeout_ms -1 must be a whole number of ms"),
        ("gpu_call_timeout_s = 0", "gpu_call_timeout_s 0 must be in (0, 86400]"),
        ('compression = "gzip"', "compression 'gzip' with compress_level 1: must be one of "
         "zstd, lz4"),
        ('compression = "lz4"\ncompress_level = 13', "lz4 level 13 must be in [-50, 12]"),
        ("compress_level = 22", "zstd level 22 must be in [-50, 19]"),
        ("spill_ram_mib = -2", "spill_ram_mib -2 must be a whole number of MiB"),
    ],
)
def test_a_negative_gpu_timeout_is_a_bad_configuration(
    setting: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #15: a negative lock timeout used to become 0, the driver's "wait forever"."""
    from ckptd.daemon.main import main

    config = tmp_path / "ckptd.toml"
    config.write_text(setting + "\n")
    assert main(["--store", "/nonexistent-ckptd-store", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
