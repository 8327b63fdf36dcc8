"""A job whose log rotates, as Python's logging does it: a RotatingFileHandler on job.log
(maxBytes small, many backups), one line per step. Deterministic: the same arguments give
the same bytes in job.log, job.log.1, ... It creates ``finished`` when done.

    python rotating.py DIR STEPS INTERVAL_MS
"""

import hashlib
import logging
import logging.handlers
import os
import sys
import time

directory, steps, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1000
handler = logging.handlers.RotatingFileHandler(
    os.path.join(directory, "job.log"), maxBytes=400, backupCount=1000)
handler.setFormatter(logging.Formatter("%(message)s"))
log = logging.getLogger("job")
log.addHandler(handler)
log.setLevel(logging.INFO)
value = b"seed"
for step in range(steps):
    value = hashlib.sha256(value).digest()
    log.info("step %d %s", step, value.hex())
    time.sleep(interval)
log.info("done")
handler.close()
open(os.path.join(directory, "finished"), "w").close()
