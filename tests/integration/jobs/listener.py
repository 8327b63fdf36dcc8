"""A TCP server on loopback that does not accept until told: ``listener.py PORT_FILE GATE``.

It listens on 127.0.0.1 (a port of the kernel's choice, written to PORT_FILE), prints a
counter every 50 ms and accepts nothing while GATE does not exist, so a client's connection
waits in the listening socket's queue (connected, not accepted: an in-flight connection to
CRIU). Once GATE exists it prints ``accepting`` and answers each connection with ``echo:`` and
the line it got, then closes it."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path


def main() -> None:
    port_file, gate = Path(sys.argv[1]), Path(sys.argv[2])
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.getsockname()[1]))
    os.rename(tmp, port_file)
    i = 0
    while not gate.exists():
        print(i, flush=True)
        i += 1
        time.sleep(0.05)
    print("accepting", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            data = conn.recv(64)
            conn.sendall(b"echo:" + data)


if __name__ == "__main__":
    main()
