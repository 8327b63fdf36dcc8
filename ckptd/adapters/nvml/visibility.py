"""Which of this node's GPUs a process can use: its container's device nodes and its
``NVIDIA_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``.

``read_view`` reads what restricts a process from /proc (a ``proc`` path parameter, so tests
use a fake tree); ``visible_uuids`` and the parse functions under it are pure. Together they
answer ``GpuInventoryPort.visible_to`` for ``NvmlInventory``.

The rules, applied to the node's GPUs as NVML lists them (``NodeGpu``):

1. Device nodes. A process whose root is not the node's own root (not that of ``/proc/1``
   nor the daemon's, by ``st_dev``/``st_ino``) — a container — can open only the GPUs that
   have a ``/dev/nvidia<N>`` node in its root, N being the GPU's minor number
   (``nvmlDeviceGetMinorNumber``; a character device of major 195 is read by its minor, any
   other file by its name). No such node at all: the process sees no GPU. A process in the
   node's own root is not restricted by device nodes.
2. ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA container runtime's, set by Kubernetes' device
   plugin to the GPUs the pod was given), only for a process in a container: CUDA itself
   ignores it, so in the node's own root it restricts nothing. Unset or ``all``: no
   restriction; ``none``, ``void`` or empty: no GPU; else a comma-separated list of node
   indices (NVML's) and UUIDs (``GPU-…``). Entries naming no GPU of this node are skipped.
3. ``CUDA_VISIBLE_DEVICES``, everywhere. Unset or ``all``: no restriction (CUDA itself has no
   ``all``; ckptd reads it as the obvious intent); empty, ``none``, ``void``: no GPU; else
   indices and UUIDs (a unique prefix of ``GPU-…``, as CUDA accepts), and as CUDA does, the
   list ends at the first entry that names no GPU. Indices count among the GPUs the device
   nodes leave visible ordered by PCI bus id — CUDA's order with
   ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. ckptd always assumes that order: CUDA's default,
   ``FASTEST_FIRST``, cannot be known without the driver (on a node of one GPU model the two
   agree in practice, ties being broken by PCI bus id); a note says so where the visible GPUs
   differ in model and the order is not ``PCI_BUS_ID``.

MIG forms (``MIG-…``, ``0:1``) are not followed: a variable holding one restricts nothing,
with a note (the CUDA checkpoint API does not support MIG anyway). The environment read is
the one the process started with (``/proc/<pid>/environ``).

The same answer serves the dump: the GPUs a CUDA process could see are recorded as
``GpuFacts.visible_gpus``, and a restore's remap names exactly those (``ckptd.core.gpu_domain``).

Invariants: the result is None exactly when nothing restricts the process; otherwise it is
a tuple of distinct UUIDs of the given GPUs, in the GPUs' (NVML index) order.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import GpuUnavailable

NVIDIA_MAJOR = 195
"""Character device major number of ``/dev/nvidia<N>`` (and nvidiactl, minor 255)."""
NVIDIA_VAR = "NVIDIA_VISIBLE_DEVICES"
CUDA_VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"

_NODE = re.compile(r"nvidia(\d+)")
_NOTHING = frozenset({"", "none", "void"})


@dataclass(frozen=True)
class NodeGpu:
    """One GPU of this node as the visibility rules need it."""

    index: int
    """NVML's index (what ``NVIDIA_VISIBLE_DEVICES`` indices name)."""
    uuid: str
    minor: int
    """The N of ``/dev/nvidia<N>``; -1 when NVML could not tell (no device node matches)."""
    pci_bus_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ProcessView:
    """What restricts one process's GPUs, as read from /proc."""

    pid: int
    minors: frozenset[int] | None
    """Minor numbers of the ``/dev/nvidia<N>`` nodes in its root; None: the node's root."""
    environ: Mapping[str, str]

    @property
    def restricted(self) -> bool:
        """Whether anything may restrict it (else every GPU is visible, NVML not needed)."""
        return self.minors is not None or CUDA_VAR in self.environ


@dataclass(frozen=True)
class Visibility:
    """``uuids``: the visible GPUs (None: not restricted); ``notes``: what was assumed."""

    uuids: tuple[str, ...] | None
    notes: tuple[str, ...] = ()


# ---- /proc -----------------------------------------------------------------------------------


def read_view(pid: int, proc: Path = Path("/proc")) -> ProcessView:
    """``pid``'s device nodes and environment. Raises ``GpuUnavailable`` (the OS error as
    cause) when its root or environment cannot be read: the process is gone, or the daemon
    may not look."""
    base = proc / str(pid)
    try:
        environ = parse_environ((base / "environ").read_bytes())
        root = base / "root"
        here = os.stat(root)
        minors = None if _is_node_root(here, proc) else device_minors(root / "dev")
    except OSError as exc:
        raise GpuUnavailable(
            f"cannot tell which GPUs pid {pid} sees: {exc.strerror or exc} ({exc.filename})",
            hint="run the restore from a live process the daemon may inspect",
            pid=pid,
        ) from exc
    return ProcessView(pid, minors, environ)


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/<pid>/environ`` (NUL-separated ``NAME=value``) as a dict; entries without
    ``=`` are skipped, the last of a repeated name wins."""
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def device_minors(dev: Path) -> frozenset[int]:
    """The minor numbers of the ``nvidia<N>`` entries of ``dev`` (empty when ``dev`` is
    missing). Raises OSError when ``dev`` exists but cannot be listed."""
    try:
        entries = list(os.scandir(dev))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()
    minors: set[int] = set()
    for entry in entries:
        match = _NODE.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat()
        except OSError:
            continue  # a dangling link is no device
        if stat.S_ISCHR(info.st_mode) and os.major(info.st_rdev) == NVIDIA_MAJOR:
            minors.add(os.minor(info.st_rdev))
        elif not stat.S_ISCHR(info.st_mode):
            minors.add(int(match.group(1)))  # not a real node (tests): its name says
    return frozenset(minors)


def _is_node_root(here: os.stat_result, proc: Path) -> bool:
    for other in (proc / "1" / "root", proc / "self" / "root"):
        try:
            there = os.stat(other)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
            return True
    return False


# ---- the rules (pure) ------------------------------------------------------------------------


def visible_uuids(gpus: Sequence[NodeGpu], view: ProcessView) -> Visibility:
    """The GPUs of ``gpus`` that ``view``'s process can use (see the module doc)."""
    notes: list[str] = []
    usable = list(gpus)
    restricted = False
    if view.minors is not None:
        restricted = True
        unknown = [g for g in gpus if g.minor < 0]
        if unknown:
            notes.append(
                "NVML gave no minor number for GPU "
                + ", ".join(str(g.index) for g in unknown)
                + ": counted as without a device node"
            )
        usable = [g for g in gpus if g.minor >= 0 and g.minor in view.minors]
    chosen = {g.uuid for g in usable}
    if view.minors is not None:
        nvidia, note = nvidia_visible(view.environ.get(NVIDIA_VAR), gpus)
        notes += note
        if nvidia is not None:
            restricted = True
            chosen &= nvidia
    cuda, note = cuda_visible(
        view.environ.get(CUDA_VAR), usable, view.environ.get(ORDER_VAR, "")
    )
    notes += note
    if cuda is not None:
        restricted = True
        chosen &= cuda
    if not restricted:
        return Visibility(None, tuple(notes))
    return Visibility(tuple(g.uuid for g in gpus if g.uuid in chosen), tuple(notes))


def nvidia_visible(
    value: str | None, gpus: Sequence[NodeGpu]
) -> tuple[frozenset[str] | None, list[str]]:
    """``NVIDIA_VISIBLE_DEVICES``'s GPUs among ``gpus`` (indices are NVML's), None when it
    restricts nothing; and notes."""
    if value is None or value.strip().lower() == "all":
        return None, []
    if value.strip().lower() in _NOTHING:
        return frozenset(), []
    by_index = {g.index: g for g in gpus}
    chosen: set[str] = set()
    skipped: list[str] = []
    for token in _tokens(value):
        if _is_mig(token):
            return None, [f"{NVIDIA_VAR}={value} names a MIG device: not followed"]
        gpu = by_index.get(int(token)) if token.isdigit() else _by_uuid(token, gpus)
        if gpu is None:
            skipped.append(token)
        else:
            chosen.add(gpu.uuid)
    notes = [f"{NVIDIA_VAR} names {', '.join(skipped)}: no GPU of this node"] if skipped else []
    return frozenset(chosen), notes


def cuda_visible(
    value: str | None, gpus: Sequence[NodeGpu], order: str = ""
) -> tuple[frozenset[str] | None, list[str]]:
    """``CUDA_VISIBLE_DEVICES``'s GPUs among ``gpus`` (those CUDA can open), None when it
    restricts nothing; and notes. ``order``: ``CUDA_DEVICE_ORDER``."""
    if value is None or value.strip().lower() == "all":
        return None, []
    if value.strip().lower() in _NOTHING:
        return frozenset(), []
    tokens = _tokens(value)
    if any(_is_mig(t) for t in tokens):
        return None, [f"{CUDA_VAR}={value} names a MIG device: not followed"]
    ordered = pci_order(gpus)
    chosen: set[str] = set()
    notes: list[str] = []
    for token in tokens:
        if token.isdigit():
            gpu = ordered[int(token)] if int(token) < len(ordered) else None
        else:
            gpu = _by_uuid(token, ordered)
        if gpu is None:
            notes.append(f"{CUDA_VAR}={value}: {token!r} names no visible GPU, the list ends there")
            break
        chosen.add(gpu.uuid)
    models = {g.name for g in ordered}
    if any(t.isdigit() for t in tokens) and order != "PCI_BUS_ID" and len(models) > 1:
        notes.append(
            f"{CUDA_VAR} indices read in PCI bus order; with {ORDER_VAR}="
            f"{order or 'FASTEST_FIRST (the default)'} CUDA may number these GPUs otherwise"
        )
    return frozenset(chosen), notes


def pci_order(gpus: Sequence[NodeGpu]) -> list[NodeGpu]:
    """``gpus`` by PCI bus id (CUDA's ``PCI_BUS_ID`` order); those without one last, by
    NVML index."""
    return sorted(gpus, key=lambda g: (not g.pci_bus_id, _bus_key(g.pci_bus_id), g.index))


def _bus_key(bus_id: str) -> tuple[int, ...]:
    """``"00000000:65:00.0"`` -> (0, 0x65, 0, 0): domain, bus, device, function."""
    parts = re.split(r"[:.]", bus_id.strip())
    try:
        return tuple(int(p, 16) for p in parts)
    except ValueError:
        return ()


def _tokens(value: str) -> list[str]:
    return [t.strip() for t in value.split(",")]


def _is_mig(token: str) -> bool:
    return token.upper().startswith("MIG-") or ":" in token


def _by_uuid(token: str, gpus: Sequence[NodeGpu]) -> NodeGpu | None:
    """The GPU whose UUID is ``token`` or starts with it (``GPU-`` form, case-insensitive,
    unique); None otherwise."""
    want = token.lower()
    if not want.startswith("gpu-") or len(want) <= len("gpu-"):
        return None
    found = [g for g in gpus if g.uuid.lower().startswith(want)]
    exact = [g for g in found if g.uuid.lower() == want]
    if exact:
        return exact[0]
    return found[0] if len(found) == 1 else None
