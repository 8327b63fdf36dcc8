#!/usr/bin/env bash
# Print the pip requirements that fit this node's NVIDIA driver, when the gpu extra's newest
# cuda-bindings (13.x) do not: cuda-bindings 13.x needs driver 580.65.06 (r580 / CUDA 13.0)
# or newer, so on r570 / r575 the 12.x ones (>= 12.9.1: they release the GIL). Prints
# nothing when the driver takes 13.x, or when there is no driver (no nvidia-smi, or it
# fails): a no-op on a machine without a GPU. Used by scripts/setup.sh.
set -euo pipefail
NEEDS=580.65.06
command -v nvidia-smi >/dev/null 2>&1 || exit 0
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null \
         | awk 'NR == 1' | tr -d ' \r') || exit 0   # awk reads all: no SIGPIPE under pipefail
[[ "$driver" =~ ^[0-9]+(\.[0-9]+)*$ ]] || exit 0
oldest=$(printf '%s\n%s\n' "$NEEDS" "$driver" | sort -V | awk 'NR == 1')
if [ "$oldest" != "$NEEDS" ]; then
    printf '%s\n' 'cuda-python>=12.9.1,<13' 'cuda-bindings>=12.9.1,<13'
fi
