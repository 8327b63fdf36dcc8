#!/usr/bin/env python3
"""Inference-like CUDA workload: large weights that never change, small activations that do.

``--mib N`` MiB of float32 weights (default 8192: 8 GiB) on the GPU, in layers of 1024 x 1024
generated from a fixed seed; each step pushes a small batch (seeded CPU generator: host
memory) through every layer (``tanh(x @ W)``) and prints ``step <i> <value>``, the sum of the
output as ``repr(float)``. Between two checkpoints only the activations and a few host pages
change: a second checkpoint should store almost no new bytes (the weights deduplicate).
``done <16 hex>`` covers the final output and every layer's sum.

Output contract: native/workloads/README.md (``--steps``, ``--interval-ms``, usage errors exit
2). ``--device cpu`` runs it without a GPU (dry runs; use a small ``--mib``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time

DIM = 1024
LAYER_MIB = DIM * DIM * 4 // 2**20  # 4 MiB of float32 per layer
BATCH = 8
SEED = 0x696E_6665_72  # "infer"


def non_negative(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="infer",
        description="Inference over N MiB of unchanging weights (prints 'step <i> <sum>').",
        allow_abbrev=False,
    )
    parser.add_argument("--steps", type=non_negative, default=100,
                        help="number of steps, 0 = forever")
    parser.add_argument("--interval-ms", type=non_negative, default=100,
                        help="sleep between steps (ms)")
    parser.add_argument("--mib", type=non_negative, default=8192,
                        help=f"MiB of weights (a multiple of {LAYER_MIB})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the weights live (cpu: dry runs without a GPU)")
    args = parser.parse_args(argv)
    if args.mib < LAYER_MIB or args.mib % LAYER_MIB:
        parser.error(f"--mib must be a positive multiple of {LAYER_MIB}, got {args.mib}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except ImportError:
        print("infer: PyTorch is not installed", file=sys.stderr)
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("infer: no CUDA device available to PyTorch", file=sys.stderr)
        return 1
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)

    weights_gen = torch.Generator(device=device).manual_seed(SEED)
    scale = DIM ** -0.5
    try:
        layers = [
            torch.randn(DIM, DIM, generator=weights_gen, device=device) * scale
            for _ in range(args.mib // LAYER_MIB)
        ]
    except RuntimeError as exc:  # out of memory
        print(f"infer: cannot allocate {args.mib} MiB of weights: {exc}", file=sys.stderr)
        return 1
    inputs = torch.Generator().manual_seed(SEED + 1)  # host state: CRIU restores it

    out = torch.zeros(BATCH, DIM, device=device)
    i = 1
    with torch.no_grad():
        while args.steps == 0 or i <= args.steps:
            x = torch.randn(BATCH, DIM, generator=inputs).to(device)
            for weight in layers:
                x = torch.tanh(x @ weight)
            out = x
            value = float(out.double().sum().item())
            sys.stdout.write(f"step {i} {value!r}\n")
            sys.stdout.flush()
            if args.steps == 0 or i < args.steps:
                time.sleep(args.interval_ms / 1000.0)
            i += 1
        digest = hashlib.blake2b(digest_size=8)
        values = out.to("cpu", torch.float64).flatten().tolist()
        digest.update(struct.pack(f"<{len(values)}d", *values))
        for weight in layers:
            digest.update(struct.pack("<d", float(weight.double().sum().item())))
    sys.stdout.write(f"done {digest.hexdigest()}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
