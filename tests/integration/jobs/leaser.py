"""A job holding a write lease (``F_SETLEASE`` ``F_WRLCK``) on a file it writes: it opens the
file O_RDWR, takes the lease, and every step writes a record into it in place and prints a
line saying which lease it holds (``F_GETLEASE``) and how many lease breaks (SIGIO) it was
sent. Deterministic while nothing breaks its lease: the same arguments give the same bytes.

    python leaser.py FILE STEPS INTERVAL_MS [wronly]

``wronly``: the file is opened O_WRONLY (as CRIU's zdtm ``file_lease00`` holds its write lease).
"""

import fcntl
import hashlib
import os
import signal
import sys
import time

path, steps, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1000
breaks: list[int] = []
signal.signal(signal.SIGIO, lambda *_: breaks.append(1))
access = os.O_WRONLY if sys.argv[4:] == ["wronly"] else os.O_RDWR
fd = os.open(path, access | os.O_CREAT | os.O_TRUNC, 0o644)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
names = {fcntl.F_RDLCK: "read", fcntl.F_WRLCK: "write", fcntl.F_UNLCK: "none"}
value = b"seed"
for step in range(steps):
    value = hashlib.sha256(value).digest()
    os.pwrite(fd, value, 32 * step)
    lease = names[fcntl.fcntl(fd, fcntl.F_GETLEASE)]
    print(f"step {step} {value.hex()[:16]} lease {lease} breaks {len(breaks)}", flush=True)
    time.sleep(interval)
print("done", flush=True)
