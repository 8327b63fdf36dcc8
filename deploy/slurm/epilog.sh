#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/ckptd.sh; runs as root on each node
# after the job ended and Slurm killed the processes of the job's cgroup).
#
# A tree restored from inside the job (train.sbatch's `ckptctl restore`) is in the job's
# cgroup and Slurm has killed it. One that ckptd restored for itself (`ckptctl resume`) is in
# /ckptd-jobs/<name>-<restore> (docs/adr/0010), which Slurm does not kill: a restored training
# of this job may still be running here. Rather than leave it running outside any allocation,
# checkpoint it (which stops it) so that the requeued job resumes from there. Jobs are found by
# the checkpoint name convention of train.sbatch, "<job name>-<job id>" (so any name ending in
# "-$SLURM_JOB_ID"), through their policies (`ckptctl policy show`): each names the job's pid
# AND its start time ("started", field 22 of /proc/PID/stat when ckptd recorded the pid). A
# process at that pid with another start time is another process (the pid was reused, by this
# user's next job too): never checkpointed nor stopped. It must also belong to the job's user.
# No such process: nothing to do, exit 0. The Epilog never fails (a failing Epilog drains the
# node): problems are logged.
set -uo pipefail

socket=${CKPTD_SOCKET:-/run/ckptd/ckptd.sock}
ckptctl=${CKPTCTL:-ckptctl}
job=${SLURM_JOB_ID:?}
uid=${SLURM_JOB_UID:-}

log() {
    echo "ckptd epilog (job $job): $*" >&2
    logger -t ckptd-epilog "job $job: $*" 2>/dev/null || true
}

# name<TAB>pid<TAB>start time of each job of this Slurm job that runs here (per ckptd's record)
triples=$(timeout 30 "$ckptctl" --socket "$socket" --timeout 20 policy show --json 2>/dev/null |
    JOB="$job" python3 -c '
import json, os, sys
for p in json.load(sys.stdin):
    if p.get("name", "").endswith("-" + os.environ["JOB"]) and p.get("pid"):
        print(p["name"], p["pid"], p.get("started") or 0, sep="\t")' 2>/dev/null) || {
    log "ckptd not answering; nothing checkpointed"; exit 0; }

# The start time of the process at pid $1 (field 22 of its stat; the name, field 2, may hold
# spaces and parentheses: the fields counted after its last ")"), or nothing when none is.
start_time() {
    local stat rest
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    rest=${stat##*) }
    set -- $rest
    [ $# -ge 20 ] && printf '%s' "${20}"
}

while IFS=$'\t' read -r name pid started; do
    [ -n "$name" ] || continue
    now=$(start_time "$pid") || continue                   # ended: nothing to do
    if [ "$started" = 0 ] || [ "$now" != "$started" ]; then # pid reused: another process
        log "pid $pid is not $name's process now (started at $now, the job at $started); left alone"
        continue
    fi
    owner=$(stat -c %u "/proc/$pid" 2>/dev/null) || continue
    if [ -n "$uid" ] && [ "$owner" != "$uid" ]; then     # another user's
        continue
    fi
    log "checkpointing $name (pid $pid), still running after the job"
    if ! timeout 600 "$ckptctl" --socket "$socket" dump "$pid" --name "$name" --keep 3; then
        log "checkpoint of $name (pid $pid) failed; it is left running"
    fi
done <<< "$triples"
exit 0
