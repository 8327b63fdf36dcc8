"""Which GPUs a process sees (``ckptd.adapters.nvml.visibility`` and
``NvmlInventory.visible_to``): the parse functions, then device nodes in a fake /proc tree,
then the adapter over a stubbed pynvml."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ckptd.adapters.nvml import NvmlInventory
from ckptd.adapters.nvml.visibility import (
    NodeGpu,
    ProcessView,
    cuda_visible,
    device_minors,
    nvidia_visible,
    parse_environ,
    pci_order,
    read_view,
    visible_uuids,
)
from ckptd.errors import GpuUnavailable

from .stubs import NVMLError, NVMLError_NotSupported, StubDevice, StubNvml

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30
PID = 4100


def uuid(i: int) -> str:
    return f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}"


# NVML index order is not PCI order here: index 0 sits on bus 0x75, index 1 on bus 0x65.
BUSES = ("00000000:75:00.0", "00000000:65:00.0", "00000000:85:00.0", "00000001:05:00.0")
NODE = tuple(NodeGpu(i, uuid(i), minor=i, pci_bus_id=BUSES[i], name=H100) for i in range(4))


def uuids(*indices: int) -> frozenset[str]:
    return frozenset(uuid(i) for i in indices)


# ---- parse functions (pure) --------------------------------------------------------------------


def test_parse_environ() -> None:
    raw = b"PATH=/bin\0CUDA_VISIBLE_DEVICES=1,2\0junk\0A=x=y\0A=z\0EMPTY=\0\xff=\xfe\0"
    env = parse_environ(raw)
    assert env["PATH"] == "/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert env["A"] == "z", "the last of a repeated name wins"
    assert env["EMPTY"] == ""
    assert "junk" not in env
    assert parse_environ(b"") == {}


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, None),
        ("all", None),
        (" ALL ", None),
        ("none", frozenset()),
        ("void", frozenset()),
        ("", frozenset()),
        ("0,2", uuids(0, 2)),
        (f" 3 , {uuid(1)}", uuids(1, 3)),
        (uuid(2).upper().replace("GPU-", "gpu-"), uuids(2)),
    ],
)
def test_nvidia_visible_devices(value: str | None, want: frozenset[str] | None) -> None:
    chosen, notes = nvidia_visible(value, NODE)
    assert chosen == want
    assert notes == []


def test_nvidia_visible_devices_indices_are_nvml_indices_not_pci_order() -> None:
    assert nvidia_visible("0", NODE)[0] == uuids(0)


def test_nvidia_visible_devices_skips_what_this_node_lacks_with_a_note() -> None:
    chosen, notes = nvidia_visible(f"7,{uuid(1)},GPU-ffffffff-0000-0000-0000-000000000000", NODE)
    assert chosen == uuids(1)
    assert notes == [
        "NVIDIA_VISIBLE_DEVICES names 7, GPU-ffffffff-0000-0000-0000-000000000000: no GPU of "
        "this node"
    ]


@pytest.mark.parametrize("value", ["0:1", "MIG-4f9c2b1a-0000-0000-0000-000000000000", "1,0:0"])
def test_mig_forms_restrict_nothing_with_a_note(value: str) -> None:
    for parse in (nvidia_visible, cuda_visible):
        chosen, notes = parse(value, NODE)
        assert chosen is None
        assert len(notes) == 1 and "MIG device: not followed" in notes[0]


def test_pci_order() -> None:
    assert [g.index for g in pci_order(NODE)] == [1, 0, 2, 3]
    no_bus = NodeGpu(9, uuid(9), minor=9)
    assert pci_order([no_bus, *NODE])[-1] is no_bus


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, None),
        ("all", None),
        ("", frozenset()),
        ("none", frozenset()),
        ("void", frozenset()),
        ("0", uuids(1)),  # CUDA's device 0 is the first on the PCI bus: NVML's index 1
        ("1", uuids(0)),
        ("2,1", uuids(2, 0)),
        ("0,2,-1,1", uuids(1, 2)),  # the list ends at the first invalid entry (CUDA's rule)
        ("0,9,1", uuids(1)),
        ("x,0", frozenset()),
        (uuid(3), uuids(3)),
        ("GPU-2222", uuids(2)),  # a unique prefix
        ("0,0", uuids(1)),
    ],
)
def test_cuda_visible_devices(value: str | None, want: frozenset[str] | None) -> None:
    chosen, _ = cuda_visible(value, NODE)
    assert chosen == want


def test_cuda_visible_devices_ambiguous_prefix_ends_the_list() -> None:
    twins = [NodeGpu(0, "GPU-abcd0000-0", 0), NodeGpu(1, "GPU-abcd1111-1", 1)]
    chosen, notes = cuda_visible("GPU-abcd", twins)
    assert chosen == frozenset()
    assert notes == ["CUDA_VISIBLE_DEVICES=GPU-abcd: 'GPU-abcd' names no visible GPU, the list "
                     "ends there"]


def test_cuda_indices_over_mixed_models_note_the_assumed_order() -> None:
    mixed = [NODE[0], NodeGpu(1, uuid(1), 1, BUSES[1], A100)]
    _, notes = cuda_visible("0", mixed)
    assert notes == [
        "CUDA_VISIBLE_DEVICES indices read in PCI bus order; with CUDA_DEVICE_ORDER="
        "FASTEST_FIRST (the default) CUDA may number these GPUs otherwise"
    ]
    assert cuda_visible("0", mixed, "PCI_BUS_ID")[1] == []
    assert cuda_visible("0", NODE)[1] == [], "one model: both orders agree"


# ---- the rules together (pure) -------------------------------------------------------------


def view(minors: set[int] | None, **env: str) -> ProcessView:
    return ProcessView(PID, None if minors is None else frozenset(minors), env)


def test_the_nodes_root_without_variables_is_not_restricted() -> None:
    assert not view(None).restricted
    assert visible_uuids(NODE, view(None)).uuids is None


def test_device_nodes_restrict_a_container() -> None:
    seen = visible_uuids(NODE, view({2, 0}))
    assert seen.uuids == (uuid(0), uuid(2)), "in NVML index order"
    assert visible_uuids(NODE, view(set())).uuids == (), "no device node: no GPU"


def test_nvidia_visible_devices_narrows_a_container_only() -> None:
    assert visible_uuids(NODE, view({0, 1, 2}, NVIDIA_VISIBLE_DEVICES="1,3")).uuids == (uuid(1),)
    assert visible_uuids(NODE, view({0, 1}, NVIDIA_VISIBLE_DEVICES="all")).uuids == (
        uuid(0), uuid(1)
    )
    assert visible_uuids(NODE, view({0, 1}, NVIDIA_VISIBLE_DEVICES="none")).uuids == ()
    outside = view(None, NVIDIA_VISIBLE_DEVICES="1")
    assert not outside.restricted, "CUDA ignores NVIDIA_VISIBLE_DEVICES outside a container"
    assert visible_uuids(NODE, outside).uuids is None


def test_cuda_visible_devices_narrows_anywhere() -> None:
    assert visible_uuids(NODE, view(None, CUDA_VISIBLE_DEVICES="0")).uuids == (uuid(1),)
    assert visible_uuids(NODE, view(None, CUDA_VISIBLE_DEVICES="")).uuids == ()
    assert visible_uuids(NODE, view(None, CUDA_VISIBLE_DEVICES="all")).uuids is None


def test_cuda_indices_count_among_the_gpus_the_device_nodes_leave() -> None:
    # nodes for NVML 0 (bus 0x75) and 2 (bus 0x85): CUDA's device 1 is NVML's 2
    assert visible_uuids(NODE, view({0, 2}, CUDA_VISIBLE_DEVICES="1")).uuids == (uuid(2),)
    # NVIDIA_VISIBLE_DEVICES does not renumber: in a privileged container CUDA sees them all
    both = view({0, 1, 2, 3}, NVIDIA_VISIBLE_DEVICES="2,3", CUDA_VISIBLE_DEVICES="0,2")
    assert visible_uuids(NODE, both).uuids == (uuid(2),)


def test_a_gpu_without_a_minor_number_has_no_device_node() -> None:
    gpus = (NODE[0], NodeGpu(1, uuid(1), minor=-1))
    seen = visible_uuids(gpus, view({0, 1}))
    assert seen.uuids == (uuid(0),)
    assert seen.notes == ("NVML gave no minor number for GPU 1: counted as without a device node",)


# ---- /proc (a fake tree) ---------------------------------------------------------------------


def fake_proc(
    tmp: Path,
    pid: int = PID,
    *,
    dev: list[str] | None = None,
    env: dict[str, str] | None = None,
    via: str = "1",
) -> Path:
    """/proc with ``1/root`` and ``self/root`` (the node's root) and ``<pid>``: its environ,
    and as root the node's (``dev`` None, same as ``via``'s root) or a container's whose
    /dev holds ``dev``."""
    proc = tmp / "proc"
    host = tmp / "host"
    daemon = tmp / "daemon-root"
    for directory in (host, daemon):
        (directory / "dev").mkdir(parents=True, exist_ok=True)
    (host / "dev" / "nvidia0").touch()  # the node's nodes never restrict
    for name, root in (("1", host), ("self", daemon)):
        (proc / name).mkdir(parents=True, exist_ok=True)
        if not (proc / name / "root").exists():
            (proc / name / "root").symlink_to(root)
    base = proc / str(pid)
    base.mkdir(parents=True)
    (base / "environ").write_bytes(
        b"".join(f"{k}={v}\0".encode() for k, v in (env or {"HOME": "/root"}).items())
    )
    if dev is None:
        (base / "root").symlink_to(host if via == "1" else daemon)
    else:
        container = tmp / f"container-{pid}"
        (container / "dev").mkdir(parents=True)
        for name in dev:
            (container / "dev" / name).touch()
        (base / "root").symlink_to(container)
    return proc


@pytest.mark.parametrize("via", ["1", "self"])
def test_the_nodes_own_root_has_no_device_restriction(tmp_path: Path, via: str) -> None:
    proc = fake_proc(tmp_path, via=via, env={"CUDA_VISIBLE_DEVICES": "1"})
    got = read_view(PID, proc)
    assert got.minors is None
    assert got.environ == {"CUDA_VISIBLE_DEVICES": "1"}


def test_a_containers_device_nodes(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, dev=["nvidia3", "nvidia1", "nvidiactl", "nvidia-uvm",
                                    "nvidia-caps", "null"])
    assert read_view(PID, proc).minors == frozenset({1, 3})


def test_a_container_without_nvidia_nodes_sees_no_gpu(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, dev=["null", "nvidiactl"])
    assert read_view(PID, proc).minors == frozenset()
    assert device_minors(tmp_path / "no-such-dir") == frozenset()


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_a_character_device_is_read_by_its_numbers(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia0", stat.S_IFCHR | 0o600, os.makedev(195, 5))
    os.mknod(dev / "nvidia1", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # not NVIDIA's major
    assert device_minors(dev) == frozenset({5})


def test_a_process_that_is_gone_cannot_be_inspected(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    with pytest.raises(GpuUnavailable, match="cannot tell which GPUs pid 999 sees") as info:
        read_view(999, proc)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.pid == 999


# ---- NvmlInventory.visible_to (stubbed pynvml, fake /proc) --------------------------------------


def nvml(**fail: Exception) -> StubNvml:
    stub = StubNvml([
        StubDevice(H100, uuid(i), 80 * GIB, 80 * GIB, bus_id=BUSES[i].encode()) for i in range(4)
    ])
    stub.fail.update(fail)
    return stub


def test_the_adapter_follows_the_containers_device_nodes(tmp_path: Path) -> None:
    stub = nvml()
    stub.devices[2].minor = 7  # the node /dev/nvidia7 is NVML's GPU 2
    proc = fake_proc(tmp_path, dev=["nvidia7", "nvidia3", "nvidiactl"])
    assert NvmlInventory(stub, proc).visible_to(PID) == (uuid(2), uuid(3))
    assert (stub.inits, stub.shutdowns) == (1, 1)


def test_the_adapter_reads_the_environment(tmp_path: Path) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": uuid(3), "CUDA_VISIBLE_DEVICES": "all"}
    proc = fake_proc(tmp_path, dev=["nvidia0", "nvidia3"], env=env)
    assert NvmlInventory(nvml(), proc).visible_to(PID) == (uuid(3),)


def test_the_adapter_needs_no_nvml_when_nothing_restricts(tmp_path: Path) -> None:
    stub = nvml()
    proc = fake_proc(tmp_path, env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert NvmlInventory(stub, proc).visible_to(PID) is None
    assert stub.inits == 0


def test_the_adapter_without_nvml_sees_no_gpu(tmp_path: Path) -> None:
    stub = nvml(nvmlInit=NVMLError(999))
    proc = fake_proc(tmp_path, dev=["nvidia0"])
    assert NvmlInventory(stub, proc).visible_to(PID) == ()
    assert stub.shutdowns == 0
    stub = nvml(nvmlDeviceGetUUID=NVMLError(999))
    assert NvmlInventory(stub, proc).visible_to(PID) == ()
    assert stub.shutdowns == 1


def test_the_adapter_without_minor_numbers(tmp_path: Path) -> None:
    stub = nvml(nvmlDeviceGetMinorNumber=NVMLError_NotSupported())
    proc = fake_proc(tmp_path, dev=["nvidia0"])
    assert NvmlInventory(stub, proc).visible_to(PID) == ()
    proc_env = fake_proc(tmp_path / "b", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert NvmlInventory(stub, proc_env).visible_to(PID) == (uuid(0),), "PCI order still known"


def test_the_adapter_refuses_a_process_it_cannot_see(tmp_path: Path) -> None:
    with pytest.raises(GpuUnavailable):
        NvmlInventory(nvml(), fake_proc(tmp_path)).visible_to(PID + 1)
