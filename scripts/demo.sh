#!/usr/bin/env bash
# The demo: set up, start ckptd on a local store, start a stateful workload, checkpoint it
# (which stops it), restore it, and show it continuing from where it was.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh >/dev/null

demo=${CKPTD_DEMO_DIR:-/tmp/ckptd-demo}
rm -rf "$demo"; mkdir -p "$demo"
export CKPTD_SOCKET="$demo/ckptd.sock"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
    [ -n "${restored:-}" ] && kill -9 "$restored" 2>/dev/null || true
    [ -n "${daemon:-}" ] && kill -TERM "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
}
trap cleanup EXIT

say "starting ckptd (store $demo/store)"
.venv/bin/ckptd --socket "$CKPTD_SOCKET" --store "$demo/store" --log-level WARNING \
    2>"$demo/ckptd.log" &
daemon=$!
for _ in $(seq 50); do [ -S "$CKPTD_SOCKET" ] && break; sleep 0.1; done
.venv/bin/ckptctl check

say "starting a workload: a numeric loop printing a checksum per step to $demo/job.out"
# Started the way a scheduler's launcher does it: a shell, in a session of its own (CRIU cannot
# checkpoint a task whose session leader is outside its pid namespace), that puts it in the
# background and exits.
setsid sh -c "exec native/workloads/bin/counter --steps 40 --interval-ms 150 --mem-mib 64 \
    > '$demo/job.out' 2>&1 < /dev/null &"
sleep 0.3
pid=$(pgrep -n -f "bin/counter --steps 40")
sleep 2
echo "pid $pid, its last lines:"; tail -n 3 "$demo/job.out"

say "ckptctl dump $pid --leave-running   (a checkpoint while the job goes on)"
.venv/bin/ckptctl dump "$pid" --name demo --leave-running
sleep 1

say "ckptctl dump $pid   (another one, then the job stops: only what changed is new)"
.venv/bin/ckptctl dump "$pid" --name demo
sleep 0.5
state=$(ps -o stat= -p "$pid" 2>/dev/null | tr -d ' ' || true)
case "$state" in ""|Z*) state="gone (killed after its checkpoint was committed)";; esac
echo "job: $state; last line it wrote: $(tail -n 1 "$demo/job.out")"

say "ckptctl list"
.venv/bin/ckptctl list

say "ckptctl restore $pid   (its latest checkpoint)"
restored=$(.venv/bin/ckptctl --json restore "$pid" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
echo "restored as pid $restored; it continues where it was:"
for _ in $(seq 100); do grep -q '^done' "$demo/job.out" && break; sleep 0.2; done
lines=$(grep -c '^step' "$demo/job.out")
tail -n 4 "$demo/job.out"

say "checking it against an uninterrupted run"
native/workloads/bin/counter --steps 40 --interval-ms 0 --mem-mib 64 > "$demo/reference.out"
if cmp -s "$demo/job.out" "$demo/reference.out"; then
    echo "identical to an uninterrupted run, bit for bit ($lines steps + done)"
else
    echo "DIFFERENT from an uninterrupted run:"; diff "$demo/reference.out" "$demo/job.out" | awk 'NR <= 10'
    exit 1
fi
restored=""
