#!/usr/bin/env bash
# Set up everything ckptd needs on a Debian 12 host (as root). Idempotent and quick the
# second time:
#   - system packages (compiler, zstd, libzstd-dev, liblz4-dev and libxxhash-dev for the store's native
#     page path ckptd._pages, python3-venv, systemd tools),
#   - a CRIU that works on this kernel (scripts/install-criu.sh),
#   - .venv in the checkout with ckptd (its C extension built in place by pip install -e),
#     its GPU packages (ckptd[gpu]: cuda-python, nvidia-ml-py; they install and import
#     without a GPU or driver; cuda-bindings 12.x on a driver older than 580.65.06) and its dev
#     tools, and the manual's generator (ckptd[docs]: mkdocs, mkdocs-material, matplotlib),
#   - the native test workloads (native/workloads/bin) and the daemon's preload for CRIU run
#     in a container (native/enter-mntns/bin/ckptd_enter_mntns.so), rebuilt when changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { printf '[setup] %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    echo "setup: run as root (CRIU must be installed and run as root): sudo $0" >&2
    exit 2
fi

export DEBIAN_FRONTEND=noninteractive
PKGS=(gcc make zstd libzstd-dev liblz4-dev libxxhash-dev python3 python3-venv python3-dev systemd iproute2
      procps openssl util-linux)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

bash scripts/install-criu.sh

PY=${PYTHON:-python3}
stamp=.venv/.ckptd-installed
extras=dev,gpu,docs
# reinstalled when the package's build inputs change (the C extension's too) or it is missing
want=$({ cat pyproject.toml setup.py ckptd/_pages.c; echo "extras=$extras"; } | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! compgen -G 'ckptd/_pages*.so' >/dev/null; then
    log "installing ckptd[$extras] into .venv"
    if ! { .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip &&
           .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"; } \
           >.venv/pip.log 2>&1; then
        tail -n 30 .venv/pip.log >&2
        echo "setup: pip install failed (full log: .venv/pip.log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
# cuda-bindings 13.x need driver 580.65.06 or newer: on an older driver, the 12.x ones (no-op
# without a driver)
mapfile -t pin < <(bash scripts/cuda-bindings-pin.sh)
if [ ${#pin[@]} -gt 0 ]; then
    have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("cuda-bindings"))' \
           2>/dev/null || true)
    if [ "${have%%.*}" != 12 ]; then
        log "NVIDIA driver older than 580.65.06: installing ${pin[*]} (cuda-bindings ${have:-none})"
        .venv/bin/python -m pip install -q --disable-pip-version-check "${pin[@]}" \
            >>.venv/pip.log 2>&1 || { tail -n 30 .venv/pip.log >&2; exit 1; }
    fi
fi
if ! .venv/bin/python -c 'import ckptd._pages' 2>/dev/null; then
    log "WARNING: ckptd._pages did not build (see .venv/pip.log): the store runs its slow" \
        "pure-Python page path"
fi

# ckptd's bytecode, compiled once here as a wheel install would: an editable install leaves
# ckptd/ uncompiled, and where PYTHONDONTWRITEBYTECODE is set (or ckptd/ is read-only) no
# import ever writes it, so every ckptctl would compile its modules again (~10-30 ms a
# command). compileall writes regardless, and skips what is up to date.
.venv/bin/python -m compileall -q -j 0 ckptd >/dev/null

make -s -C native/workloads all
make -s -C native/enter-mntns all
log "ready: .venv/bin/ckptd, .venv/bin/ckptctl, CRIU $(/usr/local/sbin/criu --version 2>/dev/null | sed -n 's/^Version: *//p' || true)"
