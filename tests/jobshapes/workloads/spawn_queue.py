"""A loop fed by a process of multiprocessing's ``spawn`` context through a Queue (issue 34).

    python spawn_queue.py --out-dir DIR [--steps 30] [--pace 0.2]

A spawn-context Queue holds a Lock and a BoundedSemaphore: named POSIX semaphores, which
glibc maps from a temporary /dev/shm name it unlinks at once while the semaphore stays linked
as ``/dev/shm/sem.mp-*`` (CRIU dumps each as a deleted file still linked elsewhere, a
"link remap"). Each step the main process puts N on the queue, the spawned worker answers
with a value derived from N through a second queue, and the main process prints ``step N
loss X``, appends to DIR/train.log and rewrites DIR/state.bin (see jobfiles.py), then sleeps
``--pace`` seconds. Needs no PyTorch. Deterministic to the bit.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import time
from typing import Any

import jobfiles


def worker(todo: Any, done: Any) -> None:
    value = 1.0
    while (step := todo.get()) is not None:
        value = value * 0.5 + step / 3.0
        done.put((step, value))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pace", type=float, default=0.2, help="seconds to sleep per step")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=worker, args=(todo, done))
    proc.start()
    files = jobfiles.JobFiles(args.out_dir)
    digest = hashlib.sha256()
    for step in range(1, args.steps + 1):
        todo.put(step)
        got, value = done.get()
        assert got == step
        digest.update(value.hex().encode())
        files.step(step, value, digest.hexdigest()[:16])
        time.sleep(args.pace)
    todo.put(None)
    proc.join()
    files.done(args.steps, digest.hexdigest()[:16])


if __name__ == "__main__":
    main()
