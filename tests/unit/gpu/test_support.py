"""The CUDA adapter's pure parts: GPU UUIDs, versions, states, process ids."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from ckptd.adapters.cuda.support import (
    bytes_to_uuid,
    format_cuda_version,
    maps_nvidia_devices,
    parse_version,
    process_state,
    tgid,
    uuid_to_bytes,
)
from ckptd.domain import CudaState

from .stubs import fake_proc

NVML_UUID = "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45"
RAW = bytes.fromhex("8d3f6c2a51b74e90a3d26f0c1b9e7a45")


def test_nvml_uuid_is_its_hex_digits_in_order() -> None:
    assert uuid_to_bytes(NVML_UUID) == RAW
    assert len(uuid_to_bytes(NVML_UUID)) == 16


def test_uuid_round_trips() -> None:
    assert bytes_to_uuid(RAW) == NVML_UUID
    for _ in range(20):
        raw = uuid.uuid4().bytes
        assert uuid_to_bytes(bytes_to_uuid(raw)) == raw


@pytest.mark.parametrize(
    "text",
    [
        NVML_UUID.upper().replace("GPU-", "GPU-"),
        NVML_UUID.removeprefix("GPU-"),
        "8d3f6c2a51b74e90a3d26f0c1b9e7a45",
        f"  {NVML_UUID}\n",
    ],
)
def test_uuid_forms_accepted(text: str) -> None:
    assert uuid_to_bytes(text) == RAW


@pytest.mark.parametrize(
    "text",
    [
        "",
        "GPU-",
        "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a4",  # 31 digits
        "GPU-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a456",  # 33 digits
        "GPU-8d3f6c2a51b7-4e90-a3d2-6f0c1b9e7a45",  # wrong grouping
        "GPU-zz3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45",
        "MIG-8d3f6c2a-51b7-4e90-a3d2-6f0c1b9e7a45",
    ],
)
def test_bad_uuids_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a GPU UUID"):
        uuid_to_bytes(text)


def test_bytes_to_uuid_needs_16_bytes() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        bytes_to_uuid(b"\x00" * 15)


@pytest.mark.parametrize(
    ("version", "text"),
    [(12080, "12.8"), (12040, "12.4"), (13000, "13.0"), (12090, "12.9"), (13020, "13.2")],
)
def test_format_cuda_version(version: int, text: str) -> None:
    assert format_cuda_version(version) == text


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("13.0.2", (13, 0, 2)),
        ("13.0.1", (13, 0, 1)),
        ("12.8.0", (12, 8, 0)),
        ("13.4.4.post1", (13, 4, 4)),
        ("12.9.1rc1", (12, 9, 1)),
        ("13", (13,)),
        ("", ()),
        ("dev", ()),
    ],
)
def test_parse_version(text: str, parsed: tuple[int, ...]) -> None:
    assert parse_version(text) == parsed


def test_remap_version_gate_compares_as_tuples() -> None:
    assert parse_version("13.0.1") < (13, 0, 2) <= parse_version("13.0.2")
    assert parse_version("13.10.0") > (13, 0, 2)


def test_process_states() -> None:
    assert [process_state(v) for v in range(4)] == [
        CudaState.RUNNING,
        CudaState.LOCKED,
        CudaState.CHECKPOINTED,
        CudaState.FAILED,
    ]
    with pytest.raises(ValueError):
        process_state(4)  # CHECKPOINTING: custom storage, never asked for


def test_tgid_of_a_process_a_thread_and_nothing(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [100], threads={101: 100})
    assert tgid(100, proc) == 100
    assert tgid(101, proc) == 100
    assert tgid(102, proc) is None
    assert tgid(0, proc) is None
    assert tgid(-1, proc) is None


def test_tgid_on_the_real_proc_sees_our_threads() -> None:
    ready = threading.Event()
    done = threading.Event()
    tids: list[int] = []

    def worker() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert ready.wait(10)
        assert tids[0] != os.getpid()
        assert tgid(os.getpid()) == os.getpid()
        assert tgid(tids[0]) == os.getpid()
    finally:
        done.set()
        thread.join()


def test_maps_nvidia_devices(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [100, 200], nvidia=(200,))
    assert not maps_nvidia_devices(100, proc)
    assert maps_nvidia_devices(200, proc)
    assert not maps_nvidia_devices(300, proc)
    assert not maps_nvidia_devices(os.getpid())  # pytest uses no GPU
