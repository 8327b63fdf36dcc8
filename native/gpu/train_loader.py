#!/usr/bin/env python3
"""Deterministic PyTorch training with DataLoader worker processes, for GPU C/R checks.

``train.py``'s MLP and dataset, but the minibatches come from a ``DataLoader`` with
``--workers N`` worker processes (default 2, persistent, forked before CUDA starts): the
workers live on the CPU (host memory, pipes and shared memory between processes: CRIU
restores them), the model, the optimizer state and the loss on the GPU (the CUDA checkpoint
restores them). The order of the batches comes from a seeded ``torch.Generator``; the workers
only slice the CPU dataset, so the output does not depend on which worker serves a batch.

Prints ``step <i> <loss>`` (the full-dataset MSE as ``repr(float)``) per step and
``done <16 hex>`` (parameters and optimizer state) at the end. Output contract:
native/workloads/README.md. ``--device cpu`` runs it without a GPU (dry runs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time
from typing import Any

N_SAMPLES = 4096
N_FEATURES = 32
HIDDEN = 128
BATCH = 256
BATCHES_PER_STEP = 4
LR = 1e-3
SEED = 0x6C6F_6164  # "load"


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
        prog="train_loader",
        description="Deterministic MLP training, batches from DataLoader worker processes.",
        allow_abbrev=False,
    )
    parser.add_argument("--steps", type=non_negative, default=100,
                        help="number of steps, 0 = forever")
    parser.add_argument("--interval-ms", type=non_negative, default=100,
                        help="sleep between steps (ms)")
    parser.add_argument("--workers", type=non_negative, default=2,
                        help="DataLoader worker processes (on the CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the model lives (cpu: dry runs without a GPU)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    try:
        import torch
        from torch.utils.data import DataLoader, TensorDataset
    except ImportError:
        print("train_loader: PyTorch is not installed", file=sys.stderr)
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_loader: no CUDA device available to PyTorch", file=sys.stderr)
        return 1
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    data_gen = torch.Generator().manual_seed(SEED)
    xs = torch.randn(N_SAMPLES, N_FEATURES, generator=data_gen)
    w_true = torch.randn(N_FEATURES, 1, generator=data_gen)
    ys = torch.sin(xs @ w_true) + 0.1 * torch.randn(N_SAMPLES, 1, generator=data_gen)

    loader = DataLoader(
        TensorDataset(xs, ys), batch_size=BATCH, shuffle=True, drop_last=True,
        num_workers=args.workers, persistent_workers=args.workers > 0,
        generator=torch.Generator().manual_seed(SEED + 1),  # host state: CRIU restores it
        multiprocessing_context="fork" if args.workers > 0 else None,
    )
    batches: Any = iter(loader)  # the workers are forked here, before CUDA starts

    device = torch.device(args.device)
    all_x, all_y = xs.to(device), ys.to(device)
    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)

    loss_value = 0.0
    i = 1
    while args.steps == 0 or i <= args.steps:
        for _ in range(BATCHES_PER_STEP):
            try:
                bx, by = next(batches)
            except StopIteration:  # next epoch (persistent workers: no new fork)
                batches = iter(loader)
                bx, by = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(bx.to(device)), by.to(device))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            loss_value = torch.nn.functional.mse_loss(model(all_x), all_y).item()
        sys.stdout.write(f"step {i} {loss_value!r}\n")
        sys.stdout.flush()
        if args.steps == 0 or i < args.steps:
            time.sleep(args.interval_ms / 1000.0)
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
