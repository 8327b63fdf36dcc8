#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/ckptd.sh; runs as root on each node
# after the job ended and Slurm killed the processes of the job's cgroup).
#
# A tree restored from inside the job (train.sbatch's `ckptctl restore`) is in the job's
# cgroup and Slurm has killed it. One that ckptd restored for itself (`ckptctl resume`) is in
# /ckptd-jobs/<name>-<restore> (docs/adr/0010), which Slurm does not kill: a restored training
# of this job may still be running here. Rather than leave it running outside any allocation,
# checkpoint it (which stops it) so that the requeued job resumes from there. Jobs are found by the checkpoint name convention of
# train.sbatch, "<job name>-<job id>" (so any name ending in "-$SLURM_JOB_ID"), and must
# belong to the job's user. No such process: nothing to do, exit 0. The Epilog never fails
# (a failing Epilog drains the node): problems are logged.
set -uo pipefail

socket=${CKPTD_SOCKET:-/run/ckptd/ckptd.sock}
ckptctl=${CKPTCTL:-ckptctl}
job=${SLURM_JOB_ID:?}
uid=${SLURM_JOB_UID:-}

log() {
    echo "ckptd epilog (job $job): $*" >&2
    logger -t ckptd-epilog "job $job: $*" 2>/dev/null || true
}

# name<TAB>pid of the latest checkpoint of each name of this job
pairs=$(timeout 30 "$ckptctl" --socket "$socket" --timeout 20 list --json 2>/dev/null |
    JOB="$job" python3 -c '
import json, os, sys
latest = {}
for ck in json.load(sys.stdin):
    if ck.get("name", "").endswith("-" + os.environ["JOB"]):
        latest[ck["name"]] = ck["pid"]          # oldest first: the last one wins
for name, pid in latest.items():
    print(f"{name}\t{pid}")' 2>/dev/null) || { log "ckptd not answering; nothing checkpointed"; exit 0; }

while IFS=$'\t' read -r name pid; do
    [ -n "$name" ] || continue
    [ -d "/proc/$pid" ] || continue                      # ended: nothing to do
    owner=$(stat -c %u "/proc/$pid" 2>/dev/null) || continue
    if [ -n "$uid" ] && [ "$owner" != "$uid" ]; then     # pid reused by someone else
        continue
    fi
    log "checkpointing $name (pid $pid), still running after the job"
    if ! timeout 600 "$ckptctl" --socket "$socket" dump "$pid" --name "$name" --keep 3; then
        log "checkpoint of $name (pid $pid) failed; it is left running"
    fi
done <<< "$pairs"
exit 0
