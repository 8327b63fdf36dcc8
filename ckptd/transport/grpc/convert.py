"""Domain values <-> ckptd.v1 protobuf messages. No logic beyond the mapping, and the edge's
rules (``ckptd.transport.validate``) on every value a request brings: a request converted here
holds only values the core may trust (BadRequest otherwise, naming the field)."""

from __future__ import annotations

from google.protobuf import struct_pb2

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.core.policies import MIN_EVERY_S
from ckptd.core.ports.asides import AsideRecord
from ckptd.domain import (
    CheckpointRecord,
    CompatReport,
    DumpRequest,
    Event,
    FileKind,
    GcReport,
    GpuFacts,
    GpuInfo,
    GpuUse,
    GroupMember,
    GroupRecord,
    MigrateOutcome,
    MigrateRequest,
    NodeFingerprint,
    NodeReport,
    Policy,
    Progress,
    RestoreOutcome,
    RestoreRequest,
    StdioFact,
    VerifyReport,
)
from ckptd.errors import BadRequest
from ckptd.transport import validate as v


def dump_request(msg: pb.DumpRequest) -> DumpRequest:
    if msg.cgroup and msg.pid:
        raise BadRequest("give a pid or a cgroup, not both", field="pid")
    keep = v.count(msg.keep, "keep")
    name = v.name(msg.name, required=bool(keep))
    return DumpRequest(
        pid=v.pid(msg.pid, required=not msg.cgroup),
        leave_running=msg.leave_running,
        name=name,
        labels=v.labels(msg.labels),
        keep=keep,
        tcp_close=msg.tcp_close,
        cgroup=v.cgroup(msg.cgroup),
        files_dirs=v.files_dirs(msg.files_dirs),
    )


def verify_response(r: VerifyReport) -> pb.VerifyResponse:
    return pb.VerifyResponse(
        ok=r.ok, checked=list(r.checked), problems=list(r.problems), packs_checked=r.packs_checked
    )


def gc_response(r: GcReport) -> pb.GcResponse:
    return pb.GcResponse(
        deleted_checkpoints=list(r.deleted_checkpoints),
        packs_deleted=r.packs_deleted,
        blobs_deleted=r.blobs_deleted,
        bytes_freed=r.bytes_freed,
        packs_kept=r.packs_kept,
        bytes_kept=r.bytes_kept,
        packs_rewritten=r.packs_rewritten,
        bytes_rewritten=r.bytes_rewritten,
        packs_written=r.packs_written,
        bytes_written=r.bytes_written,
        bytes_condemned=r.bytes_condemned,
        pinned=[
            pb.GcPinned(checkpoint_id=p.checkpoint_id, packs=p.packs, bytes=p.bytes,
                        bytes_alone=p.bytes_alone)
            for p in r.pinned
        ],
        skipped=list(r.skipped),
    )


def restore_request(msg: pb.RestoreRequest) -> RestoreRequest:
    which = msg.WhichOneof("target")
    if which is None:
        raise BadRequest("give a checkpoint id, a pid or a name to restore", field="target")
    return RestoreRequest(
        checkpoint_id=v.checkpoint_id(msg.checkpoint_id) if which == "checkpoint_id" else "",
        pid=v.pid(msg.pid) if which == "pid" else 0,
        name=v.name(msg.name, required=True) if which == "name" else "",
        output_path=v.path(msg.output_path),
        gpu_map=v.gpu_map(msg.gpu_map),
        ignore_warnings=msg.ignore_warnings,
        into_callers_container=msg.into_callers_container,
        lazy=msg.lazy,
    )


def progress(p: Progress) -> pb.Progress:
    return pb.Progress(stage=p.stage, message=p.message, fraction=p.fraction)


def stdio(s: StdioFact) -> pb.StdioFact:
    return pb.StdioFact(
        pid=s.pid, fd=s.fd, kind=s.kind.value, target=s.target, on_restore=s.on_restore
    )


def gpu(g: GpuInfo) -> pb.Gpu:
    return pb.Gpu(
        index=g.index, name=g.name, uuid=g.uuid, memory_total=g.memory_total,
        memory_free=g.memory_free, compute_capability=g.compute_capability,
        pci_bus_id=g.pci_bus_id,
    )


def gpu_use(u: GpuUse) -> pb.GpuUse:
    return pb.GpuUse(pid=u.pid, uuid=u.uuid, memory=u.memory)


def gpu_facts(f: GpuFacts) -> pb.GpuFacts:
    return pb.GpuFacts(
        driver_version=f.driver_version, cuda_version=f.cuda_version,
        gpus=[gpu(g) for g in f.gpus], uses=[gpu_use(u) for u in f.uses],
        cuda_pids=list(f.cuda_pids), lock_s=f.lock_s, checkpoint_s=f.checkpoint_s,
        restore_s=f.restore_s, unlock_s=f.unlock_s,
    )


def checkpoint(r: CheckpointRecord) -> pb.Checkpoint:
    msg = pb.Checkpoint(
        id=r.id,
        pid=r.pid,
        name=r.name,
        labels=dict(r.labels),
        node=r.node,
        uid=r.uid,
        leave_running=r.leave_running,
        processes=[
            pb.ProcessFact(
                pid=p.pid, ppid=p.ppid, comm=p.comm, cmdline=list(p.cmdline), uid=p.uid,
                gid=p.gid, threads=p.threads, ns_pid=p.ns_pid,
            )
            for p in r.processes
        ],
        stdio=[stdio(s) for s in r.stdio],
        bytes=r.bytes,
        bytes_logical=r.bytes_logical,
        bytes_new=r.bytes_new,
        frozen_s=r.frozen_s,
        duration_s=r.duration_s,
        criu_version=r.criu_version,
        parent_id=r.parent_id,
        files=[pb.CapturedFile(path=f.path, size=f.size, writers=list(f.writers))
               for f in r.files],
        files_skipped=list(r.files_skipped),
        tcp_connections=r.tcp_connections,
        tcp_close=r.tcp_close,
        container=r.container,
        container_memory_limit=r.container_memory_limit,
    )
    msg.created.FromNanoseconds(int(r.created * 1e9))
    if r.gpu is not None:
        msg.gpu.CopyFrom(gpu_facts(r.gpu))
    if r.fingerprint is not None:
        msg.fingerprint.CopyFrom(fingerprint(r.fingerprint))
    return msg


def fingerprint(f: NodeFingerprint) -> pb.NodeFingerprint:
    def count(*kinds: FileKind) -> int:
        return sum(1 for n in f.files if n.kind in kinds)

    return pb.NodeFingerprint(
        arch=f.arch, cpu_model=f.cpu_model, cpu_flags=len(f.cpu_flags), kernel=f.kernel,
        libc=f.libc, criu_version=f.criu_version,
        files=count(FileKind.EXE, FileKind.MAP, FileKind.FILE),
        directories=count(FileKind.CWD), mounts=count(FileKind.MOUNT),
    )


def check_restore_response(r: CompatReport) -> pb.CheckRestoreResponse:
    return pb.CheckRestoreResponse(
        compatible=r.compatible, blocking=list(r.blocking), warnings=list(r.warnings),
        notes=list(r.notes),
    )


def restore_result(o: RestoreOutcome) -> pb.RestoreResult:
    return pb.RestoreResult(
        checkpoint_id=o.checkpoint_id,
        pid=o.pid,
        output_path=o.output_path,
        duration_s=o.duration_s,
        stdio=[stdio(s) for s in o.stdio],
        files_put_back=list(o.files_put_back),
        files_kept=list(o.files_kept),
        files_left=list(o.files_left),
        cgroup=o.cgroup,
        ns_pid=o.ns_pid,
        lazy=o.lazy,
    )


def check_response(n: NodeReport, daemon_version: str) -> pb.CheckResponse:
    return pb.CheckResponse(
        node=n.node,
        kernel=n.kernel,
        daemon_version=daemon_version,
        criu_path=n.criu.path,
        criu_version=n.criu.version,
        criu_ok=n.criu.ok,
        criu_message=n.criu.message,
        features=[pb.Feature(name=f.name, ok=f.ok, detail=f.detail) for f in n.features],
        gpu_available=n.gpu_available,
        gpu_message=n.gpu_message,
        store=n.store,
        gpus=[gpu(g) for g in n.gpu.gpus] if n.gpu else [],
        gpu_driver=n.gpu.driver_version if n.gpu else "",
        cuda_version=n.gpu.cuda_version if n.gpu else 0,
        gpu_uses=[gpu_use(u) for u in n.gpu.uses] if n.gpu else [],
        cgroup_hierarchy=n.runtime.cgroup,
        cap_sys_resource=n.runtime.cap_sys_resource,
        oci_runtimes=list(n.runtime.oci_runtimes),
        podman_runtime=n.runtime.podman_runtime,
        warnings=list(n.runtime.warnings),
    )


def migrate_request(msg: pb.MigrateRequest) -> MigrateRequest:
    return MigrateRequest(
        pid=v.pid(msg.pid),
        to=v.address(msg.to, "--to address"),
        name=v.name(msg.name),
        labels=v.labels(msg.labels),
        output_path=v.path(msg.output_path),
        ignore_warnings=msg.ignore_warnings,
    )


def migrate_result(o: MigrateOutcome) -> pb.MigrateResult:
    return pb.MigrateResult(
        checkpoint_id=o.checkpoint_id,
        node=o.node,
        address=o.address,
        pid=o.pid,
        output_path=o.output_path,
        pages_total=o.pages_total,
        pages_sent=o.pages_sent,
        bytes_sent=o.bytes_sent,
        frozen_s=o.frozen_s,
        downtime_s=o.downtime_s,
        transfer_s=o.transfer_s,
        shared_store=o.shared_store,
    )


def event(e: Event) -> pb.Event:
    fields = struct_pb2.Struct()
    fields.update({k: v if isinstance(v, str | bool) else float(v) for k, v in e.fields.items()
                   if isinstance(v, str | bool | int | float)})
    return pb.Event(
        seq=e.seq, time=e.time, kind=e.kind.value, pid=e.pid, checkpoint_id=e.checkpoint_id,
        name=e.name, message=e.message, fields=fields,
    )


def policy(p: Policy) -> pb.Policy:
    return pb.Policy(
        name=p.name, pid=p.pid, every_s=p.every_s, keep=p.keep, on_term=p.on_term, uid=p.uid,
        last_fired=p.last_fired, last_checkpoint_id=p.last_checkpoint_id,
        last_error=p.last_error, drained_checkpoint_id=p.drained_checkpoint_id,
        started=max(0, p.started), files_dirs=list(p.files_dirs),
    )


def aside(r: AsideRecord) -> pb.Aside:
    return pb.Aside(path=r.path, dev=r.dev, ino=r.ino, uid=r.uid, restore_id=r.restore_id,
                    checkpoint_id=r.checkpoint_id, made=r.made, in_container=r.in_container)


def policy_from(msg: pb.Policy) -> Policy:
    return Policy(name=v.name(msg.name, "job name", required=True),
                  pid=v.pid(msg.pid, required=False),
                  every_s=v.duration(msg.every_s, "--every period", minimum=MIN_EVERY_S),
                  keep=v.count(msg.keep, "keep"), on_term=msg.on_term,
                  files_dirs=v.files_dirs(msg.files_dirs))


def group(g: GroupRecord) -> pb.Group:
    return pb.Group(
        id=g.id, name=g.name, created=g.created,
        members=[pb.GroupMember(node=m.node, address=m.address, checkpoint_id=m.checkpoint_id,
                                pid=m.pid) for m in g.members],
    )


def group_from(msg: pb.Group) -> GroupRecord:
    return GroupRecord(
        id=msg.id, name=msg.name, created=msg.created,
        members=tuple(GroupMember(node=m.node, address=m.address,
                                  checkpoint_id=m.checkpoint_id, pid=m.pid)
                      for m in msg.members),
    )
