#!/usr/bin/env bash
# The checks of ckptd on a GPU machine (issue 22), one command, no network:
#
#   scripts/device-check.sh OUTDIR [--dry-run] [--criu PATH] [device_check.py options]
#
# Installs the bundle's wheels (.device/wheels) into /tmp/site, prints `criu check --all`,
# the kernel facts ckptd needs and the GPUs, then runs scripts/device_check.py: the checks,
# the figures, OUTDIR/report.md and OUTDIR/report.json, a short table last. CRIU: --criu
# PATH, else the bundle's .device/criu/criu, else /usr/local/sbin/criu or criu on PATH.
# --dry-run (no GPU): CPU jobs and a fake GPU in the daemon, GPU-only steps skipped.
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--dry-run] [--criu PATH] [--budget-s S] [--sizes-gib 1,8]" >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
OUTDIR=$1; shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE" || exit 1
DRY=0
CRIU=""
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; PASS+=("$1") ;;
        --criu) [ $# -ge 2 ] || usage; CRIU=$2; shift ;;
        --criu=*) CRIU=${1#--criu=} ;;
        *) PASS+=("$1") ;;
    esac
    shift
done
if [ -z "$CRIU" ]; then
    for c in .device/criu/criu /usr/local/sbin/criu /usr/sbin/criu; do
        if [ -x "$c" ]; then CRIU=$c; break; fi
    done
    [ -n "$CRIU" ] || CRIU=$(command -v criu || echo criu)
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ $DRY = 1 ] && [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python  # the dev machine
else PY=python3; fi
case "$CRIU" in /*) ;; */*) CRIU="$HERE/$CRIU" ;; esac
mkdir -p "$OUTDIR" || exit 1
OUTDIR=$(cd "$OUTDIR" && pwd)

section() { printf '\n==== %s\n' "$*"; }
{
    section "bundle"
    SITE=/tmp/site
    PIPX=()
    if [ $DRY = 1 ]; then
        # the dev machine's Python may not be the bundle's 3.12: install the cp312 wheels
        # aside (exercising the step) and keep using the venv's packages
        SITE=/tmp/site-dry-run; rm -rf "$SITE"
        PIPX=(--python-version 3.12 --implementation cp --only-binary=:all:)
    fi
    if ls .device/wheels/*.whl >/dev/null 2>&1; then
        mkdir -p "$SITE"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "${PIPX[@]}" .device/wheels/*.whl \
            && echo "installed $(ls .device/wheels/*.whl | wc -l) wheels into $SITE" \
            || echo "pip install from .device/wheels FAILED (exit $?)"
    else
        echo "no .device/wheels: using the Python packages already installed"
    fi

    section "native page path (ckptd._pages)"
    # Built here, for this machine's Python, from the bundle's kit (.device/pages): headers of
    # zstd/xxhash and libzstd.so.1 (rpath). The dry run builds it aside (the venv has its own).
    if [ $DRY = 0 ] && "$PY" -c 'import ckptd._pages' 2>/dev/null; then
        echo "ckptd._pages: already importable"
    elif [ -d .device/pages/include ] && command -v gcc >/dev/null; then
        inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        ext=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
        dest=ckptd; [ $DRY = 1 ] && dest=$(mktemp -d /tmp/pages-dry-run.XXXXXX)
        if [ ! -f "$inc/Python.h" ]; then
            echo "ckptd._pages: NOT built: no $inc/Python.h (pure-Python page path, slower)"
        elif timeout 120 gcc -O3 -pthread -shared -fPIC -Wall -I"$inc" -I.device/pages/include \
                ckptd/_pages.c -o "$dest/_pages$ext" -L"$HERE/.device/pages/lib" -l:libzstd.so.1 -l:liblz4.so.1 \
                -Wl,-rpath,"$HERE/.device/pages/lib" 2>&1 | tail -5; then
            if [ $DRY = 1 ]; then
                PYTHONPATH="$dest" "$PY" -c 'import _pages' 2>/dev/null && echo "ckptd._pages: built aside and imported (dry run: $dest)" || echo "ckptd._pages: built aside, NOT importable"
            else
                PYTHONPATH="$HERE" "$PY" -c 'import ckptd._pages' && echo "ckptd._pages: built for $("$PY" -V) ($dest/_pages$ext)" || echo "ckptd._pages: built, NOT importable (pure-Python page path)"
            fi
        else
            echo "ckptd._pages: NOT built: gcc failed (pure-Python page path, slower)"
        fi
    else
        echo "ckptd._pages: NOT built: no .device/pages kit or no gcc (pure-Python page path)"
    fi

    section "criu: $CRIU"
    timeout 60 "$CRIU" --version 2>&1 | head -3
    timeout 120 "$CRIU" check --all 2>&1 | tail -40; echo "criu check --all: exit ${PIPESTATUS[0]}"
    timeout 60 "$CRIU" check --feature mem_dirty_track 2>&1 | tail -1

    section "kernel"
    uname -r
    if [ -w /proc/sys/kernel/ns_last_pid ]; then echo "ns_last_pid: writable"; else echo "ns_last_pid: NOT writable"; fi
    "$PY" -c 'import os; os.close(os.pidfd_open(os.getpid())); print("pidfd_open: yes")' 2>&1 | tail -1
    [ -e /proc/self/clear_refs ] && echo "clear_refs (soft-dirty reset): present"
    [ -e /sys/fs/cgroup/cgroup.controllers ] && echo "cgroup v2: $(cat /sys/fs/cgroup/cgroup.controllers)"
    for f in yama/ptrace_scope io_uring_disabled; do
        [ -r /proc/sys/kernel/$f ] && echo "$f: $(cat /proc/sys/kernel/$f)"
    done

    section "GPUs"
    if command -v nvidia-smi >/dev/null; then timeout 60 nvidia-smi -L; else echo "no nvidia-smi"; fi
    "$PY" -c 'import sys; print("python", sys.version.split()[0])'
} 2>&1 | tee "$OUTDIR/preamble.txt"

if [ $DRY = 1 ]; then export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
else export PYTHONPATH="$HERE:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi
section "checks"
"$PY" scripts/device_check.py "$OUTDIR" --criu "$CRIU" "${PASS[@]}"
exit $?
