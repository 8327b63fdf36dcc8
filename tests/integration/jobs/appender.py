"""A job that logs as MLflow's file store and ``with open(f, "a")`` loggers do: every step it
opens its metrics file, appends a line and closes it, so no descriptor of it is open when a
checkpoint is taken; every 5 steps it writes a new file (a checkpoint of its own, written and
closed) and rewrites a small summary file in place. Deterministic: the same arguments give
the same bytes.

    python appender.py DIR STEPS INTERVAL_MS
"""

import hashlib
import os
import sys
import time

directory, steps, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1000
os.makedirs(os.path.join(directory, "saved"), exist_ok=True)
value = b"seed"
for step in range(steps):
    value = hashlib.sha256(value).digest()
    with open(os.path.join(directory, "metrics.csv"), "a") as metrics:
        metrics.write(f"{step},{value.hex()}\n")
    if step % 5 == 4:
        with open(os.path.join(directory, "saved", f"step-{step}.bin"), "wb") as saved:
            saved.write(value * 64)
        with open(os.path.join(directory, "summary.json"), "w") as summary:
            summary.write(f'{{"step": {step}, "value": "{value.hex()[: step % 13]}"}}\n')
    time.sleep(interval)
with open(os.path.join(directory, "done"), "w") as done:
    done.write("done\n")
