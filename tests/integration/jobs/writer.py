"""A job that writes files as training jobs do: every step it appends a line to its log (kept
open, O_APPEND), rewrites its state file in place (its size changes: it shrinks and grows),
and prints a line on stdout. Deterministic: the same arguments give the same bytes.

    python writer.py DIR STEPS INTERVAL_MS
"""

import hashlib
import os
import sys
import time

directory, steps, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1000
log = open(os.path.join(directory, "train.log"), "a", buffering=1)  # noqa: SIM115 (kept open)
state = open(os.path.join(directory, "state.bin"), "w+b")  # noqa: SIM115
value = b"seed"
for step in range(steps):
    value = hashlib.sha256(value).digest()
    log.write(f"step {step} {value.hex()}\n")
    state.seek(0)
    state.write(value * (1 + step % 7))
    state.truncate()
    state.flush()
    print(f"step {step} {value.hex()[:16]}", flush=True)
    time.sleep(interval)
print("done", flush=True)
