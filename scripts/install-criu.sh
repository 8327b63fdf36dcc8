#!/usr/bin/env bash
# Ensure a working CRIU (>= 4.2 by default, `criu check` passing) is installed.
#
# Uses the system's criu when it is new enough, passes `criu check` and the version has no
# patches of ours (scripts/criu-patches/$VERSION); otherwise builds
# CRIU $CRIU_VERSION (default 4.2.1) from Debian's source package (upstream tarball only,
# fetched through apt) and installs it as $PREFIX/sbin/criu, /usr/local/sbin/criu by default
# (the path ckptd looks at first by default). Our own build of another version or from other
# patches (e.g. an earlier 4.1.1) is rebuilt. Idempotent: a second run with a working CRIU
# does nothing. Needs root.
#
#   CKPTD_CRIU_VERSION    4.2.1 (default) or 4.1.1 (the previous one, still buildable)
#   CKPTD_CRIU_PREFIX     install prefix (default /usr/local): $PREFIX/sbin/criu
#   CKPTD_CRIU_BUILD_DIR  build directory (default /var/cache/ckptd/criu-build)
set -euo pipefail

CRIU_VERSION=${CKPTD_CRIU_VERSION:-4.2.1}
PREFIX=${CKPTD_CRIU_PREFIX:-/usr/local}
BUILD_ROOT=${CKPTD_CRIU_BUILD_DIR:-/var/cache/ckptd/criu-build}

log() { printf '[install-criu] %s\n' "$*" >&2; }

# Per version: the Debian suite whose source package has it, the upstream tarball's sha256.
# Stock 4.1.1 cannot dump any TCP socket on Linux >= 6.16 (the kernel answers EOPNOTSUPP for
# SO_PASSCRED there, CRIU issue #2718): our 4.1.1 build carries the fix in
# scripts/criu-patches/4.1.1. 4.2.x asks for SO_PASSCRED/SO_PASSSEC on Unix and netlink
# sockets only, so it needs no such fix; scripts/criu-patches/4.2.1 lets `criu swrk` stream
# a restore's images (docs/design/streaming.md; `criu check --feature rpc_stream`). With
# patches for the version, a system CRIU is not used: only our build of them.
case $CRIU_VERSION in
    4.2.1) SUITE=sid
           SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9 ;;
    4.1.1) SUITE=trixie
           SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe ;;
    *) log "unknown CKPTD_CRIU_VERSION $CRIU_VERSION (known: 4.2.1, 4.1.1)"; exit 2 ;;
esac
MIN_VERSION=${CRIU_VERSION%.*}   # a system CRIU older than the version we build is not used

PATCH_DIR=$(cd "$(dirname "$0")" && pwd)/criu-patches/$CRIU_VERSION
shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
shopt -u nullglob
PATCH_ID=$(cat /dev/null "${PATCHES[@]}" | sha256sum | cut -c1-16)
MARKER=$PREFIX/share/ckptd/criu-build-id

criu_ok() {  # $1 = path to a criu binary
    local bin=$1 ver
    [ -x "$bin" ] || return 1
    ver=$("$bin" --version 2>/dev/null | awk 'sub(/^Version: */, "") && !v {v = $0} END {print v}')
    [ -n "$ver" ] || return 1
    if ! printf '%s\n%s\n' "$MIN_VERSION" "$ver" | sort -V -C; then
        log "$bin is version $ver, need >= $MIN_VERSION"
        return 1
    fi
    "$bin" check >/dev/null 2>&1 || { log "$bin check failed"; return 1; }
    return 0
}

ours_current() {  # our own build, of this version, from the current patches?
    [ "$(cat "$MARKER" 2>/dev/null)" = "$CRIU_VERSION+$PATCH_ID" ]
}

# Our own build of another version or other patches is replaced, whatever else is installed:
# it stays first in ckptd's search (/usr/local/sbin/criu) otherwise.
if [ -x "$PREFIX/sbin/criu" ] && [ -s "$MARKER" ] && ! ours_current; then
    log "$PREFIX/sbin/criu is our build $(cat "$MARKER"), not $CRIU_VERSION+$PATCH_ID: rebuilding"
else
    for cand in "$PREFIX/sbin/criu" "$(command -v criu 2>/dev/null || true)"; do
        # With patches for this version, only our build of them will do (another CRIU,
        # however new, lacks what they add: 4.2.1's lets `criu swrk` stream a restore).
        if [ ${#PATCHES[@]} -gt 0 ] && ! { [ "$cand" = "$PREFIX/sbin/criu" ] && ours_current; }; then
            [ -z "$cand" ] || log "$cand is not our build of $CRIU_VERSION with its patches"
            continue
        fi
        if [ -n "$cand" ] && criu_ok "$cand"; then
            log "using working CRIU at $cand ($("$cand" --version | sed -n 's/^Version: *//p'))"
            exit 0
        fi
    done
fi

export DEBIAN_FRONTEND=noninteractive
BUILD_DEPS=(gcc make pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler
    protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev
    libnftables-dev libgnutls28-dev uuid-dev libaio-dev libdrm-dev xz-utils dpkg-dev patch)
missing=()
for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get update; installing build dependencies: ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$BUILD_ROOT"
cd "$BUILD_ROOT"
TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
if [ ! -s "$TARBALL" ]; then
    log "fetching CRIU $CRIU_VERSION source through apt (Debian $SUITE's source package)"
    # A private, source-only apt configuration for $SUITE: nothing is added to the system's
    # sources and nothing binary can come from $SUITE by accident.
    APT_DIR=$BUILD_ROOT/apt-$SUITE
    mkdir -p "$APT_DIR/lists/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
         "http://deb.debian.org/debian $SUITE main" > "$APT_DIR/sources.list"
    APT_OPTS=(-o "Dir::Etc::sourcelist=$APT_DIR/sources.list" -o "Dir::Etc::sourceparts=-"
              -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache::pkgcache="
              -o "Dir::Cache::srcpkgcache=" -o "APT::Sandbox::User=root")
    apt-get "${APT_OPTS[@]}" update -qq
    # apt-get source takes an exact version (no wildcard): the Debian revision of ours.
    DEB_VERSION=$(apt-cache "${APT_OPTS[@]}" showsrc criu 2>/dev/null | sed -n 's/^Version: *//p' \
                  | awk -v want="^${CRIU_VERSION}-" '$0 ~ want && !v {v = $0} END {print v}' || true)
    [ -n "$DEB_VERSION" ] || { log "Debian $SUITE has no source package criu $CRIU_VERSION"; exit 1; }
    # apt-get source reports 404 for the Debian patch tarball and exits non-zero;
    # the upstream tarball alone is all the build needs.
    apt-get "${APT_OPTS[@]}" source --download-only "criu=$DEB_VERSION" >/dev/null 2>&1 || true
    [ -s "$TARBALL" ] || { log "could not fetch $TARBALL through apt from Debian $SUITE"; exit 1; }
fi
if ! echo "$SHA256  $TARBALL" | sha256sum -c --quiet - >/dev/null 2>&1; then
    log "$TARBALL does not have the expected sha256 $SHA256: removed"
    rm -f "$TARBALL"
    exit 1
fi
SRC_DIR="criu-${CRIU_VERSION}"
if [ ! -x "$SRC_DIR/criu/criu" ] || [ "$(cat "$SRC_DIR/.ckptd-patches" 2>/dev/null)" != "$PATCH_ID" ]; then
    rm -rf "$SRC_DIR"
    tar -xf "$TARBALL"
    for p in "${PATCHES[@]}"; do
        log "applying $CRIU_VERSION/$(basename "$p")"
        patch -d "$SRC_DIR" -p1 --quiet < "$p"
    done
    echo "$PATCH_ID" > "$SRC_DIR/.ckptd-patches"
    log "building CRIU $CRIU_VERSION (about 30 s on 2 cores)"
    make -C "$SRC_DIR" -j"$(nproc)" criu >build.log 2>&1 || { tail -n 30 build.log >&2; exit 1; }
fi
install -D -m 0755 "$SRC_DIR/criu/criu" "$PREFIX/sbin/criu.new"
mv -f "$PREFIX/sbin/criu.new" "$PREFIX/sbin/criu"
mkdir -p "$(dirname "$MARKER")" && echo "$CRIU_VERSION+$PATCH_ID" > "$MARKER"
criu_ok "$PREFIX/sbin/criu" || { log "built CRIU fails 'criu check'"; "$PREFIX/sbin/criu" check || true; exit 1; }
log "installed CRIU $CRIU_VERSION at $PREFIX/sbin/criu"
