"""Can this node restore a checkpoint? The checkpoint's node fingerprint against this node.

Every difference is one plain-words line, either *blocking* (a restore would fail or run a
different program: other architecture, missing CPU features, a changed library or data file,
a missing file or working directory, GPUs that cannot take the CUDA state) or a *warning* (the
restore is likely to work but the node is not the one dumped on: other kernel, CRIU or libc,
a file touched but with the same content). ``check_restore`` lists every one of them; it never
stops at the first.

Checkpoints made before fingerprints existed (``record.fingerprint`` None) are only checked
for their GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence

from ckptd.core.gpu import GpuSteps
from ckptd.core.jobfiles import check_files
from ckptd.core.ports import JobFiles, NodeInspector
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    FileKind,
    FileNeed,
    NodeFingerprint,
    TcpConnection,
)
from ckptd.errors import GpuMismatch, GpuUnavailable, Incompatible

_EXECUTABLE = (FileKind.EXE, FileKind.MAP)


def check_restore(
    record: CheckpointRecord,
    here: NodeInspector,
    *,
    criu_version: str = "",
    gpu: GpuSteps | None = None,
    gpu_map: Mapping[str, str] | None = None,
    include_gpu: bool = True,
    files: JobFiles | None = None,
    visible: Sequence[str] | None = None,
    shared_files: str = "keep",
    launchers: Collection[int] = (),
) -> CompatReport:
    """Every blocking difference and every warning between ``record``'s needs and this node
    (``here``; ``criu_version``: this node's CRIU; ``gpu``: its GPU steps, for CUDA trees,
    whose problems are left out when not ``include_gpu``; ``visible``: the GPUs the
    restoring container sees, see ``gpu_problems``; ``files``: this node's files, to check
    that the captured ones can be put back, and which of them processes outside the tree
    but ``launchers`` write now: ``shared_files``), and the notes of what a restore
    changes."""
    blocking: list[str] = []
    warnings: list[str] = []
    captured = {f.path for f in record.files}
    if record.fingerprint is not None:
        node = here.here()
        _node(record.fingerprint, node, criu_version, blocking, warnings)
        needs = tuple(n for n in record.fingerprint.files if n.path not in captured)
        changed = _files(needs, here, blocking, warnings)
        _libc(record.fingerprint, node, changed, warnings)
    file_blocking, file_notes = check_files(record, files, shared_files, launchers)
    notes = [*file_notes, *tcp_notes(record, here)]
    blocking.extend(file_blocking)
    if include_gpu and record.gpu is not None:
        blocking.extend(gpu_problems(record, gpu, gpu_map, visible))
    return CompatReport(blocking=tuple(blocking), warnings=tuple(warnings), notes=tuple(notes))


def tcp_missing(record: CheckpointRecord, here: NodeInspector) -> tuple[TcpConnection, ...]:
    """The connections of ``record`` (``record.tcp``) whose local address this node lacks
    (a migration that did not keep it): CRIU restores a tree's connections all established
    or all closed, so one of them makes a restore here bring every one back closed. Empty
    when the checkpoint was dumped with ``--tcp-close`` (all closed anyway)."""
    if record.tcp_close:
        return ()
    return tuple(c for c in record.tcp if not here.has_address(c.local))


def show_tcp(connections: Sequence[TcpConnection], limit: int = 8) -> str:
    """``local -> remote (STATE)``, comma-separated, the first ``limit`` of them."""
    shown = ", ".join(f"{c.local} -> {c.remote} ({c.state})" for c in connections[:limit])
    more = f" and {len(connections) - limit} more" if len(connections) > limit else ""
    return shown + more


def tcp_notes(record: CheckpointRecord, here: NodeInspector) -> list[str]:
    """What a restore here does with the TCP connections CRIU's images hold."""
    if not record.tcp:
        return []
    count = f"{len(record.tcp)} TCP connection(s)"
    if record.tcp_close:
        return [f"brings back {count} closed (dumped with --tcp-close; the application sees "
                f"a reset): {show_tcp(record.tcp)}"]
    missing = tcp_missing(record, here)
    if missing:
        return [f"brings back {count} closed, not established, because this node lacks the "
                f"local address of {show_tcp(missing)} (CRIU restores a tree's connections "
                f"all established or all closed; the application sees a reset): "
                f"{show_tcp(record.tcp)}"]
    return [f"brings back {count} established: {show_tcp(record.tcp)}"]


def gpu_problems(
    record: CheckpointRecord,
    gpu: GpuSteps | None,
    gpu_map: Mapping[str, str] | None,
    visible: Sequence[str] | None = None,
) -> list[str]:
    """The GPU plan's problems (``GpuSteps.plan_restore``), one line each. ``visible``: the
    UUIDs the restoring container sees (``GpuSteps.visible_to``; None: every GPU)."""
    if record.gpu is None:
        return []
    if gpu is None:
        return [f"the checkpoint holds CUDA processes {list(record.gpu.cuda_pids)} but this "
                "daemon has no GPU support"]
    try:
        gpu.plan_restore(record.gpu, dict(gpu_map or {}), visible)
    except GpuMismatch as exc:
        return list(exc.problems)
    except GpuUnavailable as exc:
        return [exc.message]
    return []


def refuse_unless_compatible(
    record: CheckpointRecord, report: CompatReport, *, ignore_warnings: bool,
    where: str = "this node",
) -> None:
    """Raise ``Incompatible`` listing every difference, unless there is none (or only
    warnings and ``ignore_warnings``)."""
    if not report.blocking and (ignore_warnings or not report.warnings):
        return
    parts = [f"blocking: {b}" for b in report.blocking]
    parts += [f"warning: {w}" for w in report.warnings]
    if report.blocking and where != "this node":
        hint = ("start the new container from the image the job ran in (the files it maps "
                "unchanged), with its volumes and enough memory")
    elif report.blocking:
        hint = "restore it on a node that matches, or put the files back as they were"
    else:
        hint = "restore with --ignore-warnings to accept these differences"
    raise Incompatible(
        f"checkpoint {record.id} does not fit {where}: " + "; ".join(parts),
        hint=hint,
        blocking=report.blocking,
        warnings=report.warnings,
        checkpoint_id=record.id,
    )


# ---- the parts -------------------------------------------------------------------------------


def _node(
    then: NodeFingerprint,
    now: NodeFingerprint,
    criu_version: str,
    blocking: list[str],
    warnings: list[str],
) -> None:
    if then.arch != now.arch:
        blocking.append(f"architecture differs: checkpoint {then.arch}, this node {now.arch}")
    else:
        lacking = [f for f in then.cpu_flags if f not in set(now.cpu_flags)]
        if lacking:
            blocking.append(f"CPU lacks {', '.join(lacking)} used at dump")
    if then.kernel and now.kernel and then.kernel != now.kernel:
        warnings.append(f"kernel differs: {then.kernel} -> {now.kernel}")
    if then.criu_version and criu_version and then.criu_version != criu_version:
        warnings.append(f"CRIU version differs: {then.criu_version} -> {criu_version}")


def _libc(
    then: NodeFingerprint, now: NodeFingerprint, changed: set[str], warnings: list[str]
) -> None:
    if not then.libc or not now.libc or then.libc == now.libc:
        return
    if any(_is_libc(path) for path in changed):
        return  # the changed libc file is already blocking
    warnings.append(f"libc differs: {then.libc} -> {now.libc}")


def _what_missing_is(path: str) -> str:
    """What a missing file the job had open or mapped is, and how to keep it, where ckptd
    knows (the same line): torch.compile's kernels, compiled by Inductor and Triton into a
    cache under /tmp that a reboot or a tmp cleaner removes."""
    parts = path.split("/")
    if any(p.startswith("torchinductor_") for p in parts) or "/.triton/" in path:
        return (": it is torch.compile's Inductor/Triton cache (the kernels the job compiled, "
                "under /tmp/torchinductor_<user> by default); keep them by starting the job "
                "with TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) set to a persistent "
                "directory, or keep /tmp across the restore")
    return ""


def _is_libc(path: str) -> bool:
    name = os.path.basename(path)
    return name.startswith("libc.so") or (name.startswith("libc-") and ".so" in name)


def _files(
    needs: tuple[FileNeed, ...],
    here: NodeInspector,
    blocking: list[str],
    warnings: list[str],
) -> set[str]:
    """Checks every needed path; returns the paths found changed (blocking)."""
    changed: set[str] = set()
    for need in needs:
        if need.kind is FileKind.CWD:
            if here.file(need.path, need.kind, False) is None:
                blocking.append(f"working directory {need.path} missing")
            continue
        if need.kind is FileKind.MOUNT:
            if here.file(need.path, need.kind, False) is None:
                warnings.append(f"mount point {need.path} is not mounted on this node")
            continue
        now = here.file(need.path, need.kind, bool(need.hash))
        if now is None:
            blocking.append(f"file {need.path} missing{_what_missing_is(need.path)}")
            continue
        if need.writable:
            if now.size != need.size and not need.append_only:
                changed.add(need.path)
                blocking.append(
                    f"file {need.path} has {now.size} bytes, the checkpoint needs exactly "
                    f"{need.size} (the tree writes to it and its content was not captured; "
                    "CRIU refuses a file of another size)"
                )
            continue
        differs = []
        if now.size != need.size:
            differs.append("size")
        if now.mtime_ns != need.mtime_ns:
            differs.append("mtime")
        if need.hash and now.size == need.size and now.hash != need.hash:
            differs.append("content")
        if not differs:
            continue
        content_same = bool(need.hash) and now.hash == need.hash and now.size == need.size
        if differs == ["mtime"] and (content_same or need.kind not in _EXECUTABLE):
            why = "content unchanged" if content_same else "content not checked: large file"
            warnings.append(f"file {need.path} has a different mtime ({why})")
            continue
        changed.add(need.path)
        blocking.append(f"file {need.path} changed ({'/'.join(differs)} differs)")
    return changed

