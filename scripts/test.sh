#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every check and test tier. What .ci/run calls.
#   static:      ruff, mypy --strict, import-linter (the layer rule, pyproject.toml),
#                generated code up to date
#   unit:        no root, no CRIU (fakes from ckptd.testing), contract suites
#   integration: root + real CRIU on real processes, through the real daemon and CLI
#   containers:  root, CRIU, runc/crun/podman (installed here): jobs moved between containers
#   jobshapes:   real PyTorch jobs (DDP, DataLoader workers) under the daemon: needs
#                the pinned CPU wheel, installed here (scripts/install-torch.sh), not by setup.sh
#   slurm:       deploy/slurm on a real Slurm cluster (slurm-wlm, munge: installed here)
#   gpu:         only where an NVIDIA GPU is present (skipped, with the reason, elsewhere)
# Extra arguments go to pytest (e.g. scripts/test.sh -k restore).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/install-torch.sh .venv
# the containers tier (tests/containers): OCI runtimes and podman from Debian 12, and the
# slurm tier (tests/slurm): Slurm 22.05 and munge, whose daemons the tier starts itself; not
# needed by the daemon itself (so not in setup.sh, which the demo runs)
container_pkgs=()
for p in runc crun podman slurmctld slurmd slurm-client munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
        || container_pkgs+=("$p")
done
if [ ${#container_pkgs[@]} -gt 0 ]; then
    echo "== installing ${container_pkgs[*]} (containers tier)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${container_pkgs[@]}" >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y \
             --no-install-recommends "${container_pkgs[@]}" >/dev/null; }
fi
# every supported cuda-bindings side by side (/var/cache/ckptd/cuda-bindings, cached): the
# contract test builds the CUDA adapter's structs against each; offline, it skips saying so
.venv/bin/python scripts/cuda_bindings_versions.py >/dev/null \
    || echo "cuda-bindings versions not all installed: their contract test will skip" >&2

echo "== static checks"
.venv/bin/ruff check ckptd bench tests scripts
.venv/bin/mypy ckptd bench
.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache  # the layer rule
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bash scripts/gen-protos.sh "$tmp/_gen" >/dev/null 2>&1
if ! diff -r -x __pycache__ "$tmp/_gen" ckptd/_gen >/dev/null; then
    echo "generated code in ckptd/_gen is stale: run scripts/gen-protos.sh and commit" >&2
    exit 1
fi
echo "static checks passed"

echo "== tests (unit, contract, integration, jobshapes, gpu)"
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "pytest collected no tests" >&2
fi
exit $rc
