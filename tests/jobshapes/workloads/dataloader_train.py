"""A single-process training loop fed by a DataLoader with worker processes.

    python dataloader_train.py --out-dir DIR [--steps 30] [--pace 0.2] [--workers 2]
                               [--extra-floats 0] [--metrics-csv]

The dataset is synthetic and deterministic (item i is made from a generator seeded by i, so it
does not matter which worker makes it); batches are shuffled by a seeded generator and come
back in order (the DataLoader's default). The workers are persistent: forked once, they keep
prefetching through their queues (pipes) and hand batches over in shared memory. Each step
prints ``step N loss X`` (``float.hex``), appends to DIR/train.log and rewrites DIR/state.bin
(see jobfiles.py), then sleeps ``--pace`` seconds so that a checkpoint lands mid-run.

``--extra-floats N`` adds N more random floats to each item (a batch of 16 is then 64 N bytes
bigger: 6 MB with N = 98304), folded into the input through their mean: the batches the
workers hand over in shared memory are then torch's unlinked /dev/shm files of that size,
which CRIU dumps as ghost files (issue 24). 0 (default): the items are as they always were.

``--metrics-csv`` also logs each step as a row ``step,loss,params`` (the loss as
``float.hex``) of DIR/metrics.csv with the ``csv`` module, the file opened for appending,
written and closed again each step, as MLflow's file store or a per-step CSV logger does:
between steps the job holds no descriptor of it. Without it (default) nothing else is
written: stdout, train.log and state.bin are the same bytes either way.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import jobfiles  # first: it silences torch's warning about numpy, absent here
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

METRICS_NAME = "metrics.csv"


class Synthetic(Dataset[tuple[torch.Tensor, ...]]):
    def __init__(self, size: int, extra: int = 0) -> None:
        self.size = size
        self.extra = extra

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(10_000 + index)
        x = torch.randn(16, generator=gen)
        y = torch.sin(x[:4].sum()).reshape(1) + 0.1 * torch.randn(1, generator=gen)
        if not self.extra:
            return x, y
        return x, y, torch.randn(self.extra, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pace", type=float, default=0.2, help="seconds to sleep per step")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--extra-floats", type=int, default=0,
                        help="more random floats per item (bigger shared-memory batches)")
    parser.add_argument("--metrics-csv", action="store_true",
                        help="also append each step to DIR/metrics.csv, opened and closed "
                        "each step")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(
        Synthetic(8 * 16, args.extra_floats), batch_size=16, shuffle=True,
        generator=torch.Generator().manual_seed(7), num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    files = jobfiles.JobFiles(args.out_dir)
    metrics = os.path.join(args.out_dir, METRICS_NAME) if args.metrics_csv else None

    step = 0
    while step < args.steps:
        for x, y, *extra in loader:
            step += 1
            inputs = x + 0.1 * extra[0].mean(dim=1, keepdim=True) if extra else x
            loss = nn.functional.mse_loss(model(inputs), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            params = jobfiles.param_checksum(model)
            files.step(step, loss.item(), params)
            if metrics is not None:  # open, append one row, close: no descriptor kept
                with open(metrics, "a", newline="") as f:
                    csv.writer(f).writerow([step, float(loss.item()).hex(), params])
            time.sleep(args.pace)
            if step == args.steps:
                break
    files.done(args.steps, jobfiles.param_checksum(model))


if __name__ == "__main__":
    main()
