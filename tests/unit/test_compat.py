"""Node fingerprints and check-restore: every difference in plain words, blocking vs warning,
and the restore recipe refusing before it touches anything."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd.core.compat import check_restore
from ckptd.domain import CheckpointRecord, FileKind, GpuInfo, RestoreRequest
from ckptd.domain.model import ROOT
from ckptd.errors import Incompatible, PermissionDenied, PreconditionFailed

from .world import JOB, JOB_TREE, OTHER, USER, World, make_world

EXE = "/usr/bin/job"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
DATA = "/data/tokenizer.json"
BIG = "/data/weights.bin"
LOG = "/var/log/job.log"
STATE = "/srv/job/state.bin"
CWD = "/srv/job"
GIB = 1 << 30


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    node = w.node
    node.add_file(EXE, b"\x7fELF job")
    node.add_file(LIBC, b"", size=2 << 20)  # too big to hash
    node.add_file(DATA, b'{"vocab": 1}')
    node.add_file(BIG, b"", size=5 << 20)
    node.add_file(LOG, b"line 1\n")
    node.dirs.add(CWD)
    node.mounts.add("/data")
    for pid in JOB_TREE:  # every process uses the same files: one entry per path
        node.use(pid, EXE, FileKind.EXE)
        node.use(pid, LIBC, FileKind.MAP)
        node.use(pid, CWD, FileKind.CWD)
    node.use(JOB, DATA, FileKind.FILE)
    node.use(JOB, BIG, FileKind.FILE)
    node.use(JOB, LOG, FileKind.FILE, writable=True, append_only=True)
    node.add_file(STATE, b"state 1")
    node.use(JOB, STATE, FileKind.FILE, writable=True)
    return w


def report(w: World, record: CheckpointRecord) -> tuple[list[str], list[str]]:
    r = w.service.check_restore(ROOT, record.id)
    assert r.compatible == (not r.blocking and not r.warnings)
    return list(r.blocking), list(r.warnings)


# ---- the fingerprint a dump records ---------------------------------------------------------


def test_dump_records_the_fingerprint_once_per_path(world: World) -> None:
    record = world.dump(JOB)
    fp = record.fingerprint
    assert fp is not None
    assert (fp.arch, fp.kernel, fp.libc, fp.criu_version) == (
        "x86_64", "6.8.0", "glibc 2.39", "4.1"
    )
    paths = [f.path for f in fp.files]
    assert len(paths) == len(set(paths))
    by_path = {f.path: f for f in fp.files}
    assert by_path[EXE].kind is FileKind.EXE and by_path[EXE].hash
    assert by_path[LIBC].size == 2 << 20 and by_path[LIBC].hash == ""  # only small files
    assert by_path[DATA].hash and by_path[BIG].hash == ""
    assert by_path[LOG].writable and by_path[LOG].hash == ""
    assert by_path[CWD].kind is FileKind.CWD
    assert {f.path for f in fp.files if f.kind is FileKind.MOUNT} == {"/", "/data"}


def test_the_fingerprint_is_taken_in_the_inspect_step(world: World) -> None:
    world.dump(JOB)
    assert world.events.index("node.fingerprint") < next(
        i for i, e in enumerate(world.events) if e.startswith("store.begin")
    )
    assert world.node.calls == 1


def test_the_record_round_trips_through_json(world: World) -> None:
    record = world.dump(JOB)
    again = CheckpointRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    assert again.fingerprint == record.fingerprint


def test_a_record_without_a_fingerprint_reads_back(world: World) -> None:
    data = world.dump(JOB).to_json()
    del data["fingerprint"]
    assert CheckpointRecord.from_json(data).fingerprint is None


# ---- check-restore ---------------------------------------------------------------------------


def test_the_same_node_is_compatible(world: World) -> None:
    record = world.dump(JOB)
    assert report(world, record) == ([], [])
    world.node.change_file(LOG, b"line 1\nline 2\n")  # written since: expected
    assert report(world, record) == ([], [])
    world.restore(checkpoint_id=record.id)


def test_another_architecture_is_blocking(world: World) -> None:
    record = world.dump(JOB)
    world.node.node = replace(world.node.node, arch="aarch64", cpu_flags=("fp", "asimd"))
    blocking, _ = report(world, record)
    assert blocking == ["architecture differs: checkpoint x86_64, this node aarch64"]


def test_a_missing_cpu_flag_is_blocking(world: World) -> None:
    record = world.dump(JOB)
    world.node.node = replace(world.node.node, cpu_flags=("avx2", "sse4_2", "sha_ni"))
    assert report(world, record) == (["CPU lacks avx512f used at dump"], [])


def test_a_missing_file_is_blocking(world: World) -> None:
    record = world.dump(JOB)
    del world.node.files[DATA]
    assert report(world, record) == ([f"file {DATA} missing"], [])


def test_a_missing_inductor_cache_file_says_what_it_is_and_how_to_keep_it(world: World) -> None:
    """Issue 34, 8: torch.compile maps the kernels Inductor compiled from /tmp; once /tmp is
    cleaned the restore refused with only "file ... missing"."""
    kernel = "/tmp/torchinductor_alice/ab/cabcdef.so"
    world.node.add_file(kernel, b"\x7fELF kernel")
    world.node.use(JOB, kernel, FileKind.MAP)
    record = world.dump(JOB)
    del world.node.files[kernel]
    assert report(world, record) == ([
        f"file {kernel} missing: it is torch.compile's Inductor/Triton cache (the kernels the "
        "job compiled, under /tmp/torchinductor_<user> by default); keep them by starting the "
        "job with TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) set to a persistent "
        "directory, or keep /tmp across the restore"], [])


def test_a_changed_library_is_blocking_and_hides_the_libc_warning(world: World) -> None:
    record = world.dump(JOB)
    world.node.files[LIBC].size = 3 << 20
    world.node.change_file(LIBC)
    world.node.node = replace(world.node.node, libc="glibc 2.41")
    assert report(world, record) == ([f"file {LIBC} changed (size/mtime differs)"], [])


def test_a_library_touched_is_blocking_when_too_big_to_hash(world: World) -> None:
    record = world.dump(JOB)
    world.node.change_file(LIBC)  # mtime only, content unknown
    assert report(world, record) == ([f"file {LIBC} changed (mtime differs)"], [])


def test_a_small_file_with_other_content_is_blocking(world: World) -> None:
    record = world.dump(JOB)
    world.node.change_file(DATA, b'{"vocab": 2}')  # same size
    assert report(world, record) == ([f"file {DATA} changed (mtime/content differs)"], [])


def test_only_the_mtime_differs_and_the_content_matches_is_a_warning(world: World) -> None:
    record = world.dump(JOB)
    world.node.change_file(DATA)
    world.node.change_file(EXE)
    assert report(world, record) == ([], [
        f"file {EXE} has a different mtime (content unchanged)",
        f"file {DATA} has a different mtime (content unchanged)",
    ])


def test_a_big_data_file_touched_is_a_warning(world: World) -> None:
    record = world.dump(JOB)
    world.node.change_file(BIG)
    assert report(world, record) == (
        [], [f"file {BIG} has a different mtime (content not checked: large file)"]
    )


@pytest.mark.parametrize("content", [b"", b"state 1 and more"])
def test_a_written_file_of_another_size_is_blocking_unless_appended_to(
    world: World, content: bytes
) -> None:
    """CRIU's own rule, for files whose content was not captured: a file written without
    O_APPEND must have its exact size at dump; one written only with O_APPEND, any."""
    record = world.dump(JOB)
    world.node.change_file(STATE, content)
    world.node.change_file(LOG, content)
    blocking, _ = report(world, record)
    assert blocking == [
        f"file {STATE} has {len(content)} bytes, the checkpoint needs exactly 7 (the tree "
        "writes to it and its content was not captured; CRIU refuses a file of another size)"
    ]


def test_kernel_criu_and_libc_differences_are_warnings(world: World) -> None:
    record = world.dump(JOB)
    world.node.node = replace(world.node.node, kernel="6.1.0", libc="glibc 2.36")
    world.criu.criu_status = replace(world.criu.criu_status, version="4.2")
    assert report(world, record) == ([], [
        "kernel differs: 6.8.0 -> 6.1.0",
        "CRIU version differs: 4.1 -> 4.2",
        "libc differs: glibc 2.39 -> glibc 2.36",
    ])


def test_a_missing_working_directory_is_blocking(world: World) -> None:
    record = world.dump(JOB)
    world.node.dirs.discard(CWD)
    assert report(world, record) == ([f"working directory {CWD} missing"], [])


def test_a_mount_point_not_mounted_is_a_warning(world: World) -> None:
    record = world.dump(JOB)
    world.node.mounts.discard("/data")
    assert report(world, record) == ([], ["mount point /data is not mounted on this node"])


def test_every_difference_is_listed(world: World) -> None:
    record = world.dump(JOB)
    world.node.node = replace(world.node.node, cpu_flags=(), kernel="6.1.0")
    del world.node.files[DATA]
    world.node.dirs.discard(CWD)
    blocking, warnings = report(world, record)
    assert blocking == [
        "CPU lacks avx2, avx512f, sse4_2 used at dump",
        f"working directory {CWD} missing",
        f"file {DATA} missing",
    ]
    assert warnings == ["kernel differs: 6.8.0 -> 6.1.0"]


def test_a_checkpoint_without_fingerprint_is_not_checked(world: World) -> None:
    record = replace(world.dump(JOB), fingerprint=None)
    assert check_restore(record, world.node).compatible


def test_check_restore_is_for_the_owner_or_root(world: World) -> None:
    record = world.dump(JOB, USER)
    assert world.service.check_restore(USER, record.id).compatible
    with pytest.raises(PermissionDenied):
        world.service.check_restore(OTHER, record.id)


def test_gpu_problems_are_reported_too(tmp_path: Path) -> None:
    world = make_world(tmp_path, gpu=True)
    assert world.gpu is not None
    world.gpu.add_cuda_process(1000, GIB)
    record = world.dump(JOB)
    world.gpu.gpus = [GpuInfo(0, "NVIDIA A100-SXM4-80GB",
                              "GPU-99999999-0000-0000-0000-000000000000", 80 * GIB)]
    world.node.node = replace(world.node.node, arch="aarch64")
    blocking, _ = report(world, record)
    assert blocking[0] == "architecture differs: checkpoint x86_64, this node aarch64"
    assert blocking[1].startswith("GPU model or count differs")
    with pytest.raises(Incompatible) as info:  # both, in one refusal
        world.restore(checkpoint_id=record.id)
    assert "architecture differs" in str(info.value) and "GPU model" in str(info.value)
    assert world.criu.restore_jobs == []


# ---- restore refuses ------------------------------------------------------------------------


def test_restore_refuses_blocking_differences_before_touching_anything(world: World) -> None:
    record = world.dump(JOB)
    world.node.change_file(DATA, b'{"vocab": 2}')
    world.node.dirs.discard(CWD)
    world.events.clear()
    world.criu.restore_jobs.clear()
    with pytest.raises(Incompatible) as info:
        world.restore(checkpoint_id=record.id, ignore_warnings=True)  # never overrides
    err = info.value
    assert isinstance(err, PreconditionFailed)
    assert err.checkpoint_id == record.id
    assert set(err.blocking) == {
        f"file {DATA} changed (mtime/content differs)",
        f"working directory {CWD} missing",
    }
    text = str(err)
    assert "\n" not in text
    assert f"blocking: file {DATA} changed" in text and f"working directory {CWD}" in text
    assert world.criu.restore_jobs == []
    assert not any(e.startswith(("store.checkout", "criu.", "stdio.")) for e in world.events)
    assert world.store.open_checkouts == 0
    assert [stage for stage, _ in world.progress][-2:] == ["resolve", "compat"]


def test_restore_refuses_warnings_unless_told_to_ignore_them(world: World) -> None:
    record = world.dump(JOB)
    world.node.node = replace(world.node.node, kernel="6.1.0")
    world.criu.restore_jobs.clear()
    with pytest.raises(Incompatible) as info:
        world.restore(checkpoint_id=record.id)
    assert info.value.blocking == ()
    assert info.value.warnings == ("kernel differs: 6.8.0 -> 6.1.0",)
    assert "--ignore-warnings" in str(info.value)
    assert world.criu.restore_jobs == []
    outcome = world.restore(checkpoint_id=record.id, ignore_warnings=True)
    assert outcome.checkpoint_id == record.id
    assert len(world.criu.restore_jobs) == 1


def test_the_request_carries_ignore_warnings() -> None:
    assert RestoreRequest(checkpoint_id="x").ignore_warnings is False


def test_the_grpc_messages(world: World) -> None:
    from ckptd.transport.grpc import convert

    record = world.dump(JOB)
    msg = convert.checkpoint(record).fingerprint
    assert (msg.arch, msg.kernel, msg.libc, msg.criu_version) == (
        "x86_64", "6.8.0", "glibc 2.39", "4.1"
    )
    assert (msg.cpu_flags, msg.files, msg.directories, msg.mounts) == (3, 6, 1, 2)
    world.node.node = replace(world.node.node, kernel="6.1.0")
    response = convert.check_restore_response(world.service.check_restore(ROOT, record.id))
    assert (response.compatible, list(response.blocking), list(response.warnings)) == (
        False, [], ["kernel differs: 6.8.0 -> 6.1.0"]
    )
