#!/usr/bin/env bash
# Install the pinned PyTorch CPU wheel into a venv (default .venv): what the job-shape test
# tier (tests/jobshapes) runs. Called by scripts/test.sh, not by scripts/setup.sh, so that the
# demo stays light. Idempotent: a stamp file makes the second run instant.
#
#   bash scripts/install-torch.sh [VENV]
#
# "+cpu" builds are not on PyPI. pip's own configuration may already provide one (a wheel
# directory or a mirror in pip.conf): that is tried first, without PyTorch's CPU index, because
# an index that cannot be reached costs pip minutes of retries (measured: 95 s instead of 17 s
# for a first install where that host does not resolve). Only if that fails is the CPU index
# added — what a fresh Debian 12 machine needs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${1:-.venv}
TORCH_PIN="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
stamp="$venv/.ckptd-torch"
log="$venv/torch-pip.log"

if [ "$(cat "$stamp" 2>/dev/null)" = "$TORCH_PIN" ]; then
    exit 0
fi
echo "[setup] installing $TORCH_PIN into $venv (for the job-shape tests)" >&2
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "${pip[@]}" "$TORCH_PIN" >"$log" 2>&1; then
    echo "[setup] $TORCH_PIN is not in pip's configured sources; adding $TORCH_CPU_INDEX" >&2
    if ! "${pip[@]}" --extra-index-url "$TORCH_CPU_INDEX" "$TORCH_PIN" >>"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "install-torch: pip install $TORCH_PIN failed (full log: $log)" >&2
        exit 1
    fi
fi
echo "$TORCH_PIN" >"$stamp"
