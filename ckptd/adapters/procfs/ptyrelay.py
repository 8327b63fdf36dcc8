"""Copy a pty master to a file until every slave is closed: ``ptyrelay MASTER_FD OUT_FD``."""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> int:
    master, out = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: no slave left open
            return 0
        if not data:
            return 0
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
