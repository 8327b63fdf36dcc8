#!/usr/bin/env bash
# Install ckptd as a systemd service that runs the daemon from this checkout's virtual
# environment. Idempotent: run it again after `git pull` or a new .venv.
#
# Usage: scripts/install-systemd.sh [--dry-run] [--root DIR] [--venv DIR]
#   --dry-run         print what would be done, change nothing
#   --root DIR        install under DIR instead of / (a chroot, an image, tests); never touches
#                     this machine's groups or systemd. --prefix DIR is the same.
#   --venv DIR        the virtual environment whose bin/ckptd to run (default: <checkout>/.venv)
#
# What it does (as root):
#   1. installs systemd/ckptd.service as /etc/systemd/system/ckptd.service (replaced each run:
#      put your own settings in another drop-in, e.g. ckptd.service.d/20-local.conf);
#   2. writes the drop-in /etc/systemd/system/ckptd.service.d/10-exec.conf, which resets
#      ExecStart= and runs <venv>/bin/ckptd --config /etc/ckptd/ckptd.toml;
#   3. creates the system group `ckptd` (members may use the socket) when it does not exist;
#   4. creates /etc/ckptd/ckptd.toml with every setting commented out at its default, only when
#      the file does not exist (an existing config is never touched);
#   5. when systemd runs this machine (/run/systemd/system exists): systemctl daemon-reload and
#      systemctl enable --now ckptd; otherwise says how to start it and exits 0.
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dry_run=0
root=/
venv=$checkout/.venv
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry_run=1 ;;
        --root|--prefix) [ $# -ge 2 ] || usage; root=$2; shift ;;
        --root=*|--prefix=*) root=${1#*=} ;;
        --venv) [ $# -ge 2 ] || usage; venv=$2; shift ;;
        --venv=*) venv=${1#*=} ;;
        -h|--help) usage ;;
        *) echo "install-systemd.sh: unknown argument: $1" >&2; usage ;;
    esac
    shift
done

[ -n "$root" ] || { echo "install-systemd.sh: --root needs a directory" >&2; exit 2; }
if [ "$root" != / ]; then
    [ "$dry_run" = 1 ] || mkdir -p "$root"
    root=$(cd "$root" 2>/dev/null && pwd || printf '%s' "$root")
fi
venv=$(cd "$venv" 2>/dev/null && pwd || printf '%s' "$venv")
ckptd_bin=$venv/bin/ckptd
unit_src=$checkout/systemd/ckptd.service
# Paths as the installed system sees them (written into files) ...
config_path=/etc/ckptd/ckptd.toml
# ... and where this run writes them.
base=${root%/}
unit_dst=$base/etc/systemd/system/ckptd.service
dropin_dir=$base/etc/systemd/system/ckptd.service.d
dropin_dst=$dropin_dir/10-exec.conf
config_dst=$base$config_path

say() { printf '%s\n' "$*"; }
act() {  # run a command, or print it under --dry-run
    if [ "$dry_run" = 1 ]; then say "would run: $*"; else "$@"; fi
}

# install_file DST MODE: write stdin to DST (mode MODE) when its content differs.
install_file() {
    local dst=$1 mode=$2 tmp
    tmp=$(mktemp)
    cat > "$tmp"
    if [ -f "$dst" ] && cmp -s "$tmp" "$dst"; then
        say "unchanged: $dst"
        rm -f "$tmp"
        return 0
    fi
    local verb=created
    [ -e "$dst" ] && verb=updated
    if [ "$dry_run" = 1 ]; then
        say "would write: $dst (mode $mode)"
        rm -f "$tmp"
        return 0
    fi
    mkdir -p "$(dirname "$dst")"
    install -m "$mode" "$tmp" "$dst"
    rm -f "$tmp"
    changed=1
    say "$verb: $dst"
}

if [ "$root" = / ] && [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
    echo "install-systemd.sh: must run as root (or use --dry-run, or --root DIR)" >&2
    exit 1
fi
[ -f "$unit_src" ] || { echo "install-systemd.sh: $unit_src missing" >&2; exit 1; }
if [ ! -x "$ckptd_bin" ]; then
    msg="$ckptd_bin not found: create the venv first (bash scripts/setup.sh), or pass --venv DIR"
    if [ "$dry_run" = 1 ]; then say "warning: $msg"; else echo "install-systemd.sh: $msg" >&2; exit 1; fi
fi
case $ckptd_bin in
    *[[:space:]]*|*\"*|*\\*|*%*)
        echo "install-systemd.sh: $ckptd_bin: a path with spaces, quotes, backslashes or %" \
            "cannot go into ExecStart= unescaped; use --venv with a plain path" >&2
        exit 1 ;;
esac

changed=0
where=""
[ "$root" = / ] || where=" under $root"
say "ckptd: installing the systemd unit$where (daemon: $ckptd_bin)"
[ "$dry_run" = 0 ] || say "(dry run: nothing is changed)"

# 1. the unit, as shipped
install_file "$unit_dst" 0644 < "$unit_src"

# 2. the drop-in pointing ExecStart at this checkout's venv
install_file "$dropin_dst" 0644 <<EOF
# Written by $checkout/scripts/install-systemd.sh; rewritten on every run.
# Runs ckptd from the checkout's virtual environment, with its config file. Local changes go
# into another drop-in (e.g. 20-local.conf), not here.
[Service]
ExecStart=
ExecStart=$ckptd_bin --config $config_path
EOF

# 3. the group whose members may use the socket
if [ "$root" != / ]; then
    say "skipped: group ckptd (--root: on the target run \`groupadd --system ckptd\`)"
elif getent group ckptd >/dev/null; then
    say "unchanged: group ckptd exists"
else
    act groupadd --system ckptd
    [ "$dry_run" = 1 ] || say "created: group ckptd"
fi

# 4. the config, only when absent
if [ -e "$config_dst" ]; then
    say "kept: $config_dst (exists; never overwritten)"
elif [ "$dry_run" = 1 ]; then
    say "would write: $config_dst (mode 0644, every setting commented out)"
else
    [ -d "$(dirname "$config_dst")" ] || mkdir -m 0755 -p "$(dirname "$config_dst")"
    tmp=$(mktemp)
    cat > "$tmp" <<'EOF'
# ckptd configuration (TOML). Every setting below is commented out at its default; uncomment
# and change what you need, then `systemctl restart ckptd` (restored jobs keep running).
# Command-line flags win over this file. See README.md, "Using it" and "Stores and other nodes".

# Public gRPC socket, its mode (octal, as a string) and the group allowed to use it (root only
# when the group does not exist).
# socket = "/run/ckptd/ckptd.sock"
# socket_mode = "0660"
# socket_group = "ckptd"

# Where checkpoints live: a directory or file:///dir (local disk, NFS), or an object store URL:
# s3://bucket/prefix, gs://bucket/prefix, az://container/prefix (credentials from the
# environment: put them in a drop-in with Environment=/EnvironmentFile=).
# store = "/var/lib/ckptd"
# store_endpoint = ""
# store_region = ""
# store_allow_http = false

# Journal of operations in flight, CRIU logs, restored jobs' output.
# state_dir = "/var/lib/ckptd/state"
# RAM-backed staging for dumps that fit ("" : always on disk under state_dir); root's alone
# (made root:root 0700; a link or another owner on the way stops the start).
# fast_staging_dir = "/run/ckptd/staging"

# Page compression (zstd level; threads, 0 = one per CPU).
# compress_level = 1
# compress_workers = 0

# Garbage collection: every gc_interval_s (0 = only on `ckptctl gc`); unreferenced data is
# deleted gc_grace_s after it was condemned (keep it long when daemons share a store).
# gc_interval_s = 3600.0
# gc_grace_s = 21600.0

# CUDA processes through the driver's checkpoint API (needs ckptd[gpu] and a driver >= r570).
# gpu = true
# gpu_lock_timeout_ms = 10000

# CRIU ("" : /usr/local/sbin/criu, /usr/sbin/criu, /usr/bin/criu, the first that exists).
# criu_path = ""
# criu_log_level = 4

# zombie_wait_s = 5.0
# max_workers = 16
# Seconds for running RPCs on stop, then as long again plus gpu_call_timeout_s for
# dumps/restores still under way (the unit's TimeoutStopSec=1200 allows for 60 with 900).
# shutdown_grace_s = 60.0
# log_level = "INFO"
# This node's name ("" : the host name).
# node = ""

# Restored jobs go into the cgroup of whoever asked for the restore; those the daemon restores
# for itself (resume, migrations arriving here) into <jobs_cgroup>/<job>, outside the daemon's
# cgroup ("" : the daemon's). cgroup_fs: the cgroup v2 mount ("" : found in mountinfo).
# jobs_cgroup = "/ckptd-jobs"
# cgroup_fs = ""

# Migration between daemons (mutual TLS; no TCP listener unless peer_listen is set).
# Certificates: scripts/make-peer-certs.sh /etc/ckptd/pki NODE=ADDR ...
# peer_listen = ""
# tls_cert = ""
# tls_key = ""
# tls_ca = ""
# peer_session_ttl_s = 600.0
EOF
    install -m 0644 "$tmp" "$config_dst"
    rm -f "$tmp"
    changed=1
    say "created: $config_dst"
fi

# 5. systemd
start_hint="systemctl daemon-reload && systemctl enable --now ckptd"
if [ "$root" != / ]; then
    say "installed under $root; on that system start it with: $start_hint"
    exit 0
fi
if [ ! -d /run/systemd/system ]; then
    say "systemd is not running here; installed the unit, start it with: $start_hint"
    say "(or run the daemon directly: $ckptd_bin --config $config_path)"
    exit 0
fi
act systemctl daemon-reload
if [ "$dry_run" = 0 ] && [ "$changed" = 1 ] && systemctl is-active --quiet ckptd; then
    say "ckptd is already running: \`systemctl restart ckptd\` picks up the changes" \
        "(restored jobs keep running: KillMode=process)"
fi
act systemctl enable --now ckptd
[ "$dry_run" = 1 ] || say "ckptd enabled and started: systemctl status ckptd; ckptctl check"
