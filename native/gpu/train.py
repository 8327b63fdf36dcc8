#!/usr/bin/env python3
"""Deterministic PyTorch training workload on CUDA, for GPU checkpoint/restore tests.

A small MLP (32 -> 128 -> 128 -> 1, ReLU) trained with Adam on a fixed-seed synthetic
regression dataset that lives on the GPU. Each step runs a few minibatches whose indices come
from a seeded CPU ``torch.Generator`` (host memory: CRIU restores it; the model, optimizer
state and data are device memory: the CUDA checkpoint restores them) and prints
``step <i> <loss>``, the full-dataset MSE as ``repr(float)`` (exact round trip). After the last
step it prints ``done <16 hex>``: a hash of the final parameters and optimizer state.

Output contract: native/workloads/README.md (``--steps``, ``--interval-ms``, usage errors exit
2). Deterministic: ``torch.manual_seed``, ``torch.use_deterministic_algorithms(True)``, no
TF32, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before torch is imported). Runs bit for bit the
same on the same GPU model, driver and torch; needs a CUDA GPU (exit 1 without one).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time

N_SAMPLES = 4096
N_FEATURES = 32
HIDDEN = 128
BATCH = 256
BATCHES_PER_STEP = 4
LR = 1e-3
SEED = 0x7472_6169_6E  # "train"


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
        prog="train",
        description="Deterministic MLP training on CUDA (prints 'step <i> <loss>' per step).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--steps", type=non_negative, default=100, help="number of steps, 0 = forever"
    )
    parser.add_argument(
        "--interval-ms", type=non_negative, default=100, help="sleep between steps (ms)"
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="where the model and data live (cpu: dry runs of the checks without a GPU)",
    )
    return parser.parse_args(argv)  # unknown flag: usage on stderr, exit 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    try:
        import torch
    except ImportError:
        print("train: PyTorch is not installed", file=sys.stderr)
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train: no CUDA device available to PyTorch", file=sys.stderr)
        return 1
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)

    data_gen = torch.Generator().manual_seed(SEED)
    xs = torch.randn(N_SAMPLES, N_FEATURES, generator=data_gen)
    w_true = torch.randn(N_FEATURES, 1, generator=data_gen)
    ys = torch.sin(xs @ w_true) + 0.1 * torch.randn(N_SAMPLES, 1, generator=data_gen)
    xs, ys = xs.to(device), ys.to(device)

    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    batches = torch.Generator().manual_seed(SEED + 1)  # host state: CRIU restores it

    loss_value = 0.0
    i = 1
    while args.steps == 0 or i <= args.steps:
        for _ in range(BATCHES_PER_STEP):
            index = torch.randint(0, N_SAMPLES, (BATCH,), generator=batches).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(xs[index]), ys[index])
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            loss_value = torch.nn.functional.mse_loss(model(xs), ys).item()
        sys.stdout.write(f"step {i} {loss_value!r}\n")
        sys.stdout.flush()
        if args.steps == 0 or i < args.steps:
            time.sleep(args.interval_ms / 1000.0)  # resumes after EINTR (PEP 475)
        i += 1

    digest = hashlib.blake2b(digest_size=8)
    tensors = [*model.state_dict().values()]
    for state in optimizer.state_dict()["state"].values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for tensor in tensors:
        values = tensor.detach().to("cpu", torch.float64).flatten().tolist()
        digest.update(struct.pack(f"<{len(values)}d", *values))
    digest.update(struct.pack("<d", loss_value))
    sys.stdout.write(f"done {digest.hexdigest()}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
