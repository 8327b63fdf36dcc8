#!/usr/bin/env bash
# Ensure a working CRIU (>= 4.1, `criu check` passing) is installed.
#
# Uses the system's criu when it is new enough and passes `criu check`; otherwise builds
# CRIU 4.1.1 from Debian's source package (upstream tarball only, fetched through apt) and
# installs it as /usr/local/sbin/criu (the path ckptd looks at first by default).
# Idempotent: a second run with a working CRIU does nothing.  Needs root.
set -euo pipefail

CRIU_VERSION=4.1.1
PREFIX=${CKPTD_CRIU_PREFIX:-/usr/local}
BUILD_ROOT=${CKPTD_CRIU_BUILD_DIR:-/var/cache/ckptd/criu-build}
PATCH_DIR=$(cd "$(dirname "$0")" && pwd)/criu-patches
# Our build carries the patches in scripts/criu-patches (e.g. Linux >= 6.16 answers
# EOPNOTSUPP for SO_PASSCRED on TCP sockets, which stock 4.1.1 takes for a failure: no
# process with a TCP socket could be dumped). A build from other patches is rebuilt.
PATCH_ID=$(cat "$PATCH_DIR"/*.patch 2>/dev/null | sha256sum | cut -c1-16)
MARKER=$PREFIX/share/ckptd/criu-build-id

log() { printf '[install-criu] %s\n' "$*" >&2; }

criu_ok() {  # $1 = path to a criu binary
    local bin=$1 ver
    [ -x "$bin" ] || return 1
    ver=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
    [ -n "$ver" ] || return 1
    # need >= 4.1
    if ! printf '4.1\n%s\n' "$ver" | sort -V -C; then
        log "$bin is version $ver, need >= 4.1"
        return 1
    fi
    "$bin" check >/dev/null 2>&1 || { log "$bin check failed"; return 1; }
    return 0
}

ours_current() {  # our own build, from the current patches?
    [ "$(cat "$MARKER" 2>/dev/null)" = "$CRIU_VERSION+$PATCH_ID" ]
}

for cand in "$PREFIX/sbin/criu" "$(command -v criu 2>/dev/null || true)"; do
    if [ "$cand" = "$PREFIX/sbin/criu" ] && [ -x "$cand" ] && ! ours_current \
       && "$cand" --version 2>/dev/null | grep -q "^Version: *$CRIU_VERSION\$"; then
        log "$cand is CRIU $CRIU_VERSION without the current patches: rebuilding"
        continue
    fi
    if [ -n "$cand" ] && criu_ok "$cand"; then
        log "using working CRIU at $cand ($("$cand" --version | sed -n 's/^Version: *//p'))"
        exit 0
    fi
done

export DEBIAN_FRONTEND=noninteractive
BUILD_DEPS=(gcc make pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler
    protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev
    libnftables-dev libgnutls28-dev uuid-dev libaio-dev libdrm-dev xz-utils dpkg-dev patch)
missing=()
for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

# A source-only entry for trixie: nothing binary can come from it by accident.
SRC_LIST=/etc/apt/sources.list.d/ckptd-trixie-src.sources
if [ ! -f "$SRC_LIST" ]; then
    cat > "$SRC_LIST" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    NEED_UPDATE=1
fi
if [ ${#missing[@]} -gt 0 ] || [ -n "${NEED_UPDATE:-}" ] || [ ! -d /var/lib/apt/lists ] \
   || ! ls /var/lib/apt/lists/*trixie*Sources* >/dev/null 2>&1; then
    log "apt-get update"
    apt-get update -qq
fi
if [ ${#missing[@]} -gt 0 ]; then
    log "installing build dependencies: ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$BUILD_ROOT"
cd "$BUILD_ROOT"
TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
if [ ! -s "$TARBALL" ]; then
    log "fetching CRIU $CRIU_VERSION source through apt"
    # apt-get source reports 404 for the Debian patch tarball and exits non-zero;
    # the upstream tarball alone is all the build needs.
    apt-get source --download-only "criu=${CRIU_VERSION}-*" >/dev/null 2>&1 \
        || apt-get source --download-only criu >/dev/null 2>&1 || true
    [ -s "$TARBALL" ] || { log "could not fetch $TARBALL through apt"; exit 1; }
fi
SRC_DIR="criu-${CRIU_VERSION}"
if [ ! -x "$SRC_DIR/criu/criu" ] || [ "$(cat "$SRC_DIR/.ckptd-patches" 2>/dev/null)" != "$PATCH_ID" ]; then
    rm -rf "$SRC_DIR"
    tar -xf "$TARBALL"
    for p in "$PATCH_DIR"/*.patch; do
        [ -e "$p" ] || continue
        log "applying $(basename "$p")"
        patch -d "$SRC_DIR" -p1 --quiet < "$p"
    done
    echo "$PATCH_ID" > "$SRC_DIR/.ckptd-patches"
    log "building CRIU $CRIU_VERSION (about 30 s on 2 cores)"
    make -C "$SRC_DIR" -j"$(nproc)" criu >build.log 2>&1 || { tail -n 30 build.log >&2; exit 1; }
fi
install -D -m 0755 "$SRC_DIR/criu/criu" "$PREFIX/sbin/criu"
mkdir -p "$(dirname "$MARKER")" && echo "$CRIU_VERSION+$PATCH_ID" > "$MARKER"
criu_ok "$PREFIX/sbin/criu" || { log "built CRIU fails 'criu check'"; "$PREFIX/sbin/criu" check || true; exit 1; }
log "installed CRIU $CRIU_VERSION at $PREFIX/sbin/criu"
