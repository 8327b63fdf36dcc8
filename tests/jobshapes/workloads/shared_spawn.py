"""A tensor shared with a process started by torch.multiprocessing's ``spawn``.

    python shared_spawn.py --out-dir DIR [--steps 30] [--pace 0.2] [--floats 2097152]

The main process puts a tensor of ``--floats`` float32 (8 MiB by default) in shared memory
(``share_memory_``: with torch's default ``file_descriptor`` strategy an unlinked /dev/shm
file, which CRIU dumps as a ghost file, issue 24) and hands it to one spawned worker with a
pair of pipes. Each step the main process asks the worker for step N; the worker updates the
tensor in place (halved, plus noise seeded by N) and answers; the main process then prints
``step N loss X`` (X: the tensor's sum, ``float.hex``), appends to DIR/train.log and rewrites
DIR/state.bin with the tensor's sha256 as the checksum (see jobfiles.py), and sleeps ``--pace``
seconds so that a checkpoint lands mid-run. Deterministic to the bit.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import time
from multiprocessing.connection import Connection

import jobfiles  # first: it silences torch's warning about numpy, absent here
import torch
import torch.multiprocessing as mp


def checksum(tensor: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the tensor's bytes."""
    return hashlib.sha256(ctypes.string_at(tensor.data_ptr(), tensor.nbytes)).hexdigest()[:16]


def worker(shared: torch.Tensor, todo: Connection, done: Connection) -> None:
    torch.set_num_threads(1)
    while (step := todo.recv()) is not None:
        gen = torch.Generator().manual_seed(step)
        shared.mul_(0.5).add_(torch.randn(shared.shape, generator=gen))
        done.send(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pace", type=float, default=0.2, help="seconds to sleep per step")
    parser.add_argument("--floats", type=int, default=2 << 20)
    args = parser.parse_args()

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    shared = torch.zeros(args.floats)
    shared.share_memory_()
    todo_r, todo_w = ctx.Pipe(duplex=False)
    done_r, done_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=worker, args=(shared, todo_r, done_w))
    proc.start()
    files = jobfiles.JobFiles(args.out_dir)
    for step in range(1, args.steps + 1):
        todo_w.send(step)
        assert done_r.recv() == step
        files.step(step, float(shared.sum()), checksum(shared))
        time.sleep(args.pace)
    todo_w.send(None)
    proc.join()
    files.done(args.steps, checksum(shared))


if __name__ == "__main__":
    main()
