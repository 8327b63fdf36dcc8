"""A small DistributedDataParallel training on CPU (gloo), deterministic to the bit.

    torchrun --nproc_per_node=2 ddp_train.py --out-dir DIR [--steps 30] [--pace 0.2]

or with ranks started by hand (``init_method=env://``): MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE in each rank's environment (two network namespaces: MASTER_ADDR is rank 0's
address). Rank 0 prints ``step N loss X`` (X: the mean loss over the ranks, ``float.hex``),
appends to DIR/train.log and rewrites DIR/state.bin each step (see jobfiles.py); every rank
sleeps ``--pace`` seconds between steps so that a checkpoint lands mid-run. Each rank trains
on its own synthetic batches (seeded by rank and step); gradients are averaged by DDP's
allreduce (with two ranks a sum of two, exact in any order), so the run is the same bit for
bit every time.
"""

from __future__ import annotations

import argparse
import time

import jobfiles  # first: it silences torch's warning about numpy, absent here
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1_000_003 + step)
    x = torch.randn(size, 16, generator=gen)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(size, 1, generator=gen)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pace", type=float, default=0.2, help="seconds to sleep per step")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    files = jobfiles.JobFiles(args.out_dir) if rank == 0 else None

    for step in range(1, args.steps + 1):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().to(torch.float64)
        dist.all_reduce(total)
        if files is not None:
            files.step(step, total.item() / world, jobfiles.param_checksum(model))
        time.sleep(args.pace)

    dist.barrier()
    if files is not None:
        files.done(args.steps, jobfiles.param_checksum(model))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
