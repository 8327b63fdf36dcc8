#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/ckptd.sh; runs as root on each node of
# the job before it starts, or at allocation with PrologFlags=Alloc).
#
# Fails fast when this node cannot protect jobs: ckptd does not answer on its socket, or CRIU
# is unusable there. A failing Prolog makes Slurm drain the node (with this reason) and requeue
# the job elsewhere — better than discovering at the time limit that the checkpoint cannot be
# taken. Set CKPTD_PROLOG_ENFORCE=0 in the Prolog's environment to only log.
set -uo pipefail

socket=${CKPTD_SOCKET:-/run/ckptd/ckptd.sock}
ckptctl=${CKPTCTL:-ckptctl}
enforce=${CKPTD_PROLOG_ENFORCE:-1}

fail() {
    echo "ckptd prolog (job ${SLURM_JOB_ID:-?}): $*" >&2
    logger -t ckptd-prolog "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
    [ "$enforce" = 1 ] && exit 1
    exit 0
}

# `ckptctl check` exits 3 when the daemon does not answer, 0 with a report otherwise (even when
# CRIU is unusable: hence the criu_ok test).
errf=$(mktemp); trap 'rm -f "$errf"' EXIT
report=$(timeout 30 "$ckptctl" --socket "$socket" --timeout 20 check --json 2>"$errf") \
    || fail "ckptd is not answering on $socket: $(tail -n 1 "$errf")"
ok=$(printf '%s' "$report" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("criu_ok", False))' 2>/dev/null)
[ "$ok" = True ] || fail "ckptd cannot checkpoint on this node (CRIU unusable): run \`ckptctl check\`"
exit 0
