"""Two processes of one tree talking TCP over loopback: the parent listens, its child connects,
and every step the child sends a number that the parent transforms and sends back. Prints
each step's value; deterministic. With ``--peer HOST:PORT`` the child connects there instead
(a peer outside the tree).

    python tcp_pair.py STEPS INTERVAL_MS [--peer HOST:PORT]
"""

import hashlib
import os
import socket
import sys
import time

steps, interval = int(sys.argv[1]), int(sys.argv[2]) / 1000
peer = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--peer" else ""

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
port = server.getsockname()[1]
if os.fork() == 0:
    host, _, p = peer.rpartition(":") if peer else ("127.0.0.1", ":", str(port))
    conn = socket.create_connection((host, int(p)))
    value = b"seed"
    for step in range(steps):
        conn.sendall(hashlib.sha256(value).digest())
        value = conn.recv(32, socket.MSG_WAITALL)
        print(f"step {step} {value.hex()[:16]}", flush=True)
        time.sleep(interval)
    print("done", flush=True)
    os._exit(0)
if not peer:
    conn, _ = server.accept()
    while data := conn.recv(32, socket.MSG_WAITALL):
        conn.sendall(hashlib.sha256(b"server" + data).digest())
os.wait()
