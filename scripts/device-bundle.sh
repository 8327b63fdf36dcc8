#!/usr/bin/env bash
# Fill .device/ (ignored) with what the GPU check needs that the GPU machine lacks: it has
# Python 3.12 with torch, grpcio, protobuf, psutil, xxhash, prometheus-client, cuda-bindings,
# nvidia-ml-py, pytest, ... but no package registry, no network and no CRIU.
#
#   .device/criu/criu        CRIU 4.2.1 with ckptd's patch (scripts/criu-patches), run with the
#                            bundle's own loader and libraries (glibc included), whatever the
#                            host's glibc: a static launcher that execs
#                            lib/ld-linux-x86-64.so.2 --library-path lib bin/criu "$@".
#                            Give it to the daemon as `--criu .device/criu/criu` (config `criu`).
#   .device/criu/bin/criu    the binary (/usr/local/sbin/criu here)
#   .device/criu/lib/        every library `ldd` lists for it, and the dynamic loader
#   .device/wheels/          cp312 manylinux x86_64 / pure-Python wheels of the runtime (and
#                            integration-test) dependencies the GPU image lacks, pinned, --no-deps
#   .device/lib/ckptd_enter_mntns.so   native/enter-mntns (only for jobs in containers)
#   .device/pages/           the kit to build ckptd._pages there: zstd/xxhash headers, libzstd
#   .device/README           what is here, how to use it on the GPU machine
#
# Idempotent: wheels already there are not fetched again (a second run needs no network), and
# the CRIU tree is rebuilt only when the binary, one of its libraries or the launcher changed
# (a sha256 stamp). Prints what it did and the bundle's size; fails over 48 MiB.
#
# Decisions:
# * CRIU plugins: none bundled. scripts/install-criu.sh builds only `make criu` (no
#   cuda_plugin.so / amdgpu_plugin.so), and ckptd starts every CRIU with CRIU_LIBS_DIR set to an
#   empty directory of its own (ckptd/adapters/criu/swrk.py), so CRIU's CUDA plugin never acts:
#   ckptd drives CUDA checkpoints itself through the driver API.
# * The launcher is a static executable, not a shell script: a shell wrapper would itself load
#   an LD_PRELOAD the daemon sets for CRIU in a container (native/enter-mntns) and enter the
#   container's mount namespace before exec'ing the bundle's loader (whose path is the node's).
#   A static launcher ignores LD_PRELOAD; the bundle's loader then applies it to CRIU. File
#   descriptors (`criu swrk <fd>`, inherited fds) pass through exec unchanged.
# * ckptd's native page path (ckptd/_pages.c) cannot be built here for the GPU machine's
#   Python 3.12 (Debian 12 has no 3.12 headers), so the bundle carries its kit instead:
#   pages/include (zstd.h, zstd_errors.h, xxhash.h, lz4.h, lz4frame.h) and pages/lib/libzstd.so.1,
#   liblz4.so.1, and
#   scripts/device-check.sh compiles ckptd/_pages*.so on the GPU machine with its own Python's
#   headers (and gcc, which nvcc needs there). Where that fails, ckptd.core.store.pagepath
#   falls back to its pure-Python path (tested: tests/unit, both paths); it is slower.
#
#   CKPTD_DEVICE_DIR   the bundle (default: .device in the checkout)
#   CKPTD_CRIU         the CRIU to bundle (default /usr/local/sbin/criu)
#   PYTHON             the Python whose pip downloads wheels (default: the checkout's .venv)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${CKPTD_DEVICE_DIR:-$ROOT/.device}
CRIU_SRC=${CKPTD_CRIU:-/usr/local/sbin/criu}
PY=${PYTHON:-$ROOT/.venv/bin/python}
CRIU_VERSION=4.2.1
LIMIT_MIB=48

# The runtime dependencies of ckptd (pyproject.toml `dependencies`) the GPU image lacks, and
# pyroute2 (tests/integration: netns, TCP, two nodes). Versions: those the .venv tests with.
# grpcio-health-checking/-reflection 1.85.1 are pure Python and need grpcio >= 1.85.1 and
# protobuf >= 7.35.1, < 8 at import (their generated code checks both, as ckptd/_gen's does).
# The GPU image's grpcio is 1.84.0 (seen on the H100, 2026-11-26: every import of the
# generated code refused it), so grpcio and protobuf travel too, at the venv's versions. obstore needs typing-extensions on Python < 3.13,
# which the image has (torch needs it).
WHEELS=(
    grpcio==1.85.3
    protobuf==7.36.2
    zstandard==0.25.0
    lz4==4.4.5
    obstore==0.12.1
    pyroute2==0.9.7
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

log() { printf '[device-bundle] %s\n' "$*"; }
die() { printf '[device-bundle] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$OUT/wheels" "$OUT/criu" "$OUT/lib"

# ---- wheels -------------------------------------------------------------------------------
declare -A wanted=()
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*} version=${spec##*==}
    norm=${name//-/_}
    wanted["$norm-$version"]=1
    shopt -s nullglob
    have=("$OUT/wheels/$norm-$version-"*.whl)
    shopt -u nullglob
    if [ ${#have[@]} -gt 0 ]; then
        log "wheel $spec: present ($(basename "${have[0]}"))"
        continue
    fi
    platform_args=()
    for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${platform_args[@]}" \
        -d "$OUT/wheels" "$spec" || die "pip download $spec failed (is PyPI reachable?)"
    log "wheel $spec: downloaded"
done
for whl in "$OUT/wheels"/*.whl; do   # a wheel of another version (an earlier pin) goes
    [ -e "$whl" ] || continue
    base=$(basename "$whl")
    key=$(printf '%s' "$base" | cut -d- -f1-2)
    if [ -z "${wanted[$key]:-}" ]; then
        rm -f "$whl"
        log "wheel $base: removed (not pinned)"
    fi
done

# ---- CRIU ---------------------------------------------------------------------------------
[ -x "$CRIU_SRC" ] || die "$CRIU_SRC missing: run scripts/install-criu.sh"
# Readers here consume all their input: under pipefail an early exit (head, grep -q, awk's
# exit) can SIGPIPE the writer and fail the pipeline (exit 141) depending on timing.
ver=$("$CRIU_SRC" --version | awk 'sub(/^Version: */, "") && !v {v = $0} END {print v}')
[ "$ver" = "$CRIU_VERSION" ] || die "$CRIU_SRC is CRIU '$ver', want $CRIU_VERSION"

# Every library the binary loads (ldd: NAME => PATH, and the loader as a bare path); the
# vDSO has no file.
if ldd "$CRIU_SRC" | grep 'not found' >/dev/null; then
    die "ldd $CRIU_SRC: $(ldd "$CRIU_SRC" | grep 'not found' | tr -s ' \t\n' ' ')"
fi
mapfile -t LIBS < <(ldd "$CRIU_SRC" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
LOADER=""
for lib in "${LIBS[@]}"; do
    case $(basename "$lib") in ld-linux-x86-64.so.*) LOADER=$lib ;; esac
done
[ -n "$LOADER" ] || die "ldd $CRIU_SRC names no ld-linux-x86-64.so loader"

read -r -d '' LAUNCHER_C <<'EOF' || true
/* .device/criu/criu: run bin/criu with the bundle's loader and libraries (scripts/device-bundle.sh). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    static char self[PATH_MAX], ld[PATH_MAX], lib[PATH_MAX], bin[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        perror("criu launcher: /proc/self/exe");
        return 127;
    }
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL)
        *slash = '\0';
    if (snprintf(ld, sizeof ld, "%.4000s/lib/ld-linux-x86-64.so.2", self) >= (int)sizeof ld
        || snprintf(lib, sizeof lib, "%.4000s/lib", self) >= (int)sizeof lib
        || snprintf(bin, sizeof bin, "%.4000s/bin/criu", self) >= (int)sizeof bin) {
        fprintf(stderr, "criu launcher: path too long: %s\n", self);
        return 127;
    }
    char **args = calloc((size_t)argc + 7, sizeof *args);
    if (args == NULL)
        return 127;
    int i = 0;
    args[i++] = ld;
    args[i++] = "--library-path";
    args[i++] = lib;
    args[i++] = "--argv0";
    args[i++] = argc > 0 ? argv[0] : bin;
    args[i++] = bin;
    for (int k = 1; k < argc; k++)
        args[i++] = argv[k];
    args[i] = NULL;
    execv(ld, args);
    fprintf(stderr, "criu launcher: cannot run %s: %s\n", ld, strerror(errno));
    return 127;
}
EOF

stamp=$({ sha256sum "$CRIU_SRC" "${LIBS[@]}"; printf '%s\n' "$LAUNCHER_C" | sha256sum; } \
        | awk '{print $1}' | sha256sum | cut -c1-32)
if [ "$(cat "$OUT/criu/.stamp" 2>/dev/null)" = "$stamp" ] && [ -x "$OUT/criu/criu" ]; then
    log "criu: up to date ($CRIU_SRC, ${#LIBS[@]} libraries, stamp $stamp)"
else
    command -v gcc >/dev/null || die "gcc missing (apt-get install gcc libc6-dev)"
    tmp=$(mktemp -d "$OUT/.criu.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    chmod 0755 "$tmp"
    mkdir -p "$tmp/bin" "$tmp/lib"
    cp -L "$CRIU_SRC" "$tmp/bin/criu"
    for lib in "${LIBS[@]}"; do
        cp -L "$lib" "$tmp/lib/$(basename "$lib")"
    done
    [ "$(basename "$LOADER")" = ld-linux-x86-64.so.2 ] ||
        cp -L "$LOADER" "$tmp/lib/ld-linux-x86-64.so.2"
    chmod 0755 "$tmp/bin/criu" "$tmp/lib/ld-linux-x86-64.so.2"
    printf '%s\n' "$LAUNCHER_C" > "$tmp/launcher.c"
    gcc -O2 -Wall -Wextra -Werror -static -s -o "$tmp/criu" "$tmp/launcher.c" ||
        die "cannot build the static launcher (needs libc6-dev's libc.a)"
    rm -f "$tmp/launcher.c"
    printf '%s\n' "$stamp" > "$tmp/.stamp"
    rm -rf "$OUT/criu"
    mv "$tmp" "$OUT/criu"
    trap - EXIT
    log "criu: copied $CRIU_SRC and ${#LIBS[@]} libraries, built the launcher (stamp $stamp)"
fi

chmod 0755 "$OUT/criu"

# The bundle's CRIU must run with nothing of the system's: no environment, every library
# (LD_DEBUG names each one initialised) from .device/criu/lib.
out=$(env -i "$OUT/criu/criu" --version 2>&1) || die "env -i .device/criu/criu --version failed: $out"
grep -q "^Version: $CRIU_VERSION\$" <<<"$out" || die "bundled criu says: $out"
libs_seen=$(env -i LD_DEBUG=libs "$OUT/criu/criu" --version 2>&1 >/dev/null |
            sed -n 's/.*calling init: //p')
[ -n "$libs_seen" ] || die "LD_DEBUG=libs showed no library for the bundled criu"
outside=$(grep -v "^$OUT/criu/lib/" <<<"$libs_seen" || true)
[ -z "$outside" ] || die "the bundled criu loaded libraries from outside the bundle: $outside"
log "criu: env -i .device/criu/criu --version: $CRIU_VERSION, $(wc -l <<<"$libs_seen") libraries, all from the bundle"
if [ "$(id -u)" = 0 ]; then
    out=$(env -i "$OUT/criu/criu" check 2>&1) || die "env -i .device/criu/criu check failed: $out"
    log "criu: env -i .device/criu/criu check: ${out:-ok}"
fi

# ---- native/enter-mntns (the daemon's preload for CRIU run in a container) ----------------
src=$ROOT/native/enter-mntns/enter_mntns.c
so=$OUT/lib/ckptd_enter_mntns.so
if [ -f "$so" ] && [ "$so" -nt "$src" ]; then
    log "enter-mntns: up to date"
else
    gcc -O2 -Wall -Wextra -Werror -std=gnu11 -fPIC -shared -o "$so.tmp" "$src"
    mv "$so.tmp" "$so"
    log "enter-mntns: built $so"
fi

# ---- the kit for ckptd._pages (built on the GPU machine by scripts/device-check.sh) ------
mkdir -p "$OUT/pages/include" "$OUT/pages/lib"
for h in zstd.h zstd_errors.h xxhash.h lz4.h lz4frame.h; do
    [ -f "/usr/include/$h" ] || die "/usr/include/$h missing (apt-get install libzstd-dev liblz4-dev libxxhash-dev)"
    cmp -s "/usr/include/$h" "$OUT/pages/include/$h" || cp "/usr/include/$h" "$OUT/pages/include/$h"
done
zlib=$(ldconfig -p | awk '$1 == "libzstd.so.1" && /x86-64/ && !found {print $NF; found = 1}')
[ -n "$zlib" ] || die "libzstd.so.1 not found (apt-get install libzstd1)"
cmp -s "$zlib" "$OUT/pages/lib/libzstd.so.1" || cp -L "$zlib" "$OUT/pages/lib/libzstd.so.1"
llib=$(ldconfig -p | awk '$1 == "liblz4.so.1" && /x86-64/ && !found {print $NF; found = 1}')
[ -n "$llib" ] || die "liblz4.so.1 not found (apt-get install liblz4-1)"
cmp -s "$llib" "$OUT/pages/lib/liblz4.so.1" || cp -L "$llib" "$OUT/pages/lib/liblz4.so.1"
log "pages kit: headers, $(basename "$(readlink -f "$zlib")") and $(basename "$(readlink -f "$llib")") in $OUT/pages"

# ---- README -------------------------------------------------------------------------------
readme=$(cat <<EOF
ckptd's device bundle, made by scripts/device-bundle.sh (do not edit; run it again).

On the GPU machine (Python 3.12, no registry, no network):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .device/wheels/*.whl && export PYTHONPATH=/tmp/site
  ckptd ... --criu "\$PWD/.device/criu/criu"     # config key: criu

criu/criu     CRIU $CRIU_VERSION with ckptd's patch (rpc_stream), run with the bundle's own
              loader and libraries (glibc included): static launcher, bin/criu, lib/.
              No CRIU plugins: ckptd runs CRIU with CRIU_LIBS_DIR set to an empty directory
              and drives CUDA itself.
wheels/       $(cd "$OUT/wheels" && ls -- *.whl | tr '\n' ' ')
              (--no-deps: typing-extensions comes from the machine's image; grpcio and
              protobuf travel because the image's grpcio 1.84.0 is older than ckptd/_gen needs)
lib/ckptd_enter_mntns.so   native/enter-mntns, for jobs in containers (criu_enter_preload)

pages/        the kit for ckptd's native page path: scripts/device-check.sh builds
              ckptd/_pages*.so there with the machine's Python headers, pages/include and
              pages/lib/libzstd.so.1, liblz4.so.1 (rpath). If that fails, ckptd uses its pure-Python page
              path (same results, slower; the daemon logs "ckptd._pages is not built" once).
EOF
)
if [ "$(cat "$OUT/README" 2>/dev/null)" != "$readme" ]; then
    printf '%s\n' "$readme" > "$OUT/README"
    log "README: written"
fi

# ---- size ---------------------------------------------------------------------------------
bytes=$(du -sb "$OUT" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
log "bundle: $OUT, $mib MiB ($bytes bytes; limit $LIMIT_MIB MiB)"
[ "$bytes" -le $((LIMIT_MIB * 1048576)) ] || die "the bundle is $mib MiB, over $LIMIT_MIB MiB"
