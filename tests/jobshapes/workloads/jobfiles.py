"""What the job-shape workloads share: their output lines and the files they write.

Each step, the workload that owns the files (rank 0, or the single process):

- prints ``step N loss X`` on stdout, X the loss as an exact hex float (``float.hex``);
- appends ``step N loss X params C`` to ``train.log``, a file it opened once for appending
  and keeps open (like any training log);
- rewrites ``state.bin`` in place (opened once, read-write, never closed): a header
  ``JOBSTATE``, the step, the parameter checksum, then the loss of every step so far as
  little-endian doubles — so the file grows by 8 bytes a step, and a restore from an older
  checkpoint finds it larger than it was at the checkpoint (what issue 11 is about).

At the end it prints ``done steps N params C``. Everything is deterministic: two uninterrupted
runs print and write the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

# torch warns on import when numpy is absent (it is not needed here).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

LOG_NAME = "train.log"
STATE_NAME = "state.bin"


def param_checksum(model: Any) -> str:
    """sha256 (first 16 hex digits) of every parameter's float32 bits, in order."""
    import torch

    digest = hashlib.sha256()
    for param in model.parameters():
        bits = param.detach().contiguous().view(-1).view(torch.int32).tolist()
        digest.update(struct.pack(f"<{len(bits)}i", *bits))
    return digest.hexdigest()[:16]


class JobFiles:
    """The log and state file of one run, both kept open for the whole run."""

    def __init__(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.log = open(os.path.join(out_dir, LOG_NAME), "a", buffering=1)  # noqa: SIM115
        self.state_fd = os.open(os.path.join(out_dir, STATE_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        self.losses: list[float] = []

    def step(self, step: int, loss: float, params: str) -> None:
        line = f"step {step} loss {loss.hex()}"
        print(line, flush=True)
        self.log.write(f"{line} params {params}\n")
        self.losses.append(loss)
        data = struct.pack(f"<8sQ16s{len(self.losses)}d", b"JOBSTATE", step,
                           params.encode(), *self.losses)
        os.pwrite(self.state_fd, data, 0)
        os.ftruncate(self.state_fd, len(data))

    def done(self, steps: int, params: str) -> None:
        line = f"done steps {steps} params {params}"
        self.log.write(line + "\n")
        self.log.close()
        os.close(self.state_fd)
        print(line, flush=True)
        sys.stdout.flush()
