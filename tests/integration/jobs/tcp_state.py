"""One process holding TCP sockets in a chosen state, both ends its own, over loopback:

    python tcp_state.py STATE FAMILY STEPS INTERVAL_MS     (FAMILY: 4 or 6)

STATE: ``reset`` (TCP_CLOSE: its peer reset it, the fd still open), ``halfclosed`` (one end
shut its writing side: CLOSE_WAIT here, FIN_WAIT2 there), ``fin_wait1`` (a shutdown whose FIN
waits behind data the peer does not read yet), ``last_ack`` (the same after the peer's FIN:
LAST_ACK), ``time_wait`` (a connection closed first by this process: TIME_WAIT, no fd left).
Prints "ready" once the state is reached, a counter every step, then what the sockets say
at the end (deterministic), then "done"."""

import hashlib
import socket
import struct
import sys
import time

state, family = sys.argv[1], sys.argv[2]
steps, interval = int(sys.argv[3]), int(sys.argv[4]) / 1000
fam, host = (socket.AF_INET6, "::1") if family == "6" else (socket.AF_INET, "127.0.0.1")
TCP_STATES = {1: "ESTABLISHED", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 7: "CLOSE", 8: "CLOSE_WAIT",
              9: "LAST_ACK", 11: "CLOSING"}


def tcp_state(sock: socket.socket) -> str:
    return TCP_STATES.get(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0], "?")


def pair(rcvbuf: int = 0) -> tuple[socket.socket, socket.socket]:
    server = socket.socket(fam)
    if rcvbuf:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    server.bind((host, 0))
    server.listen(1)
    a = socket.socket(fam)
    a.connect(server.getsockname()[:2])
    b, _ = server.accept()
    server.close()
    return a, b


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


PAYLOAD = bytes(range(256)) * 4096  # 1 MiB: more than a small receive window holds
a, b = pair(rcvbuf=4096 if state in ("fin_wait1", "last_ack") else 0)
if state == "reset":
    b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    b.close()
elif state == "halfclosed":
    b.shutdown(socket.SHUT_WR)
elif state in ("fin_wait1", "last_ack"):
    if state == "last_ack":
        b.shutdown(socket.SHUT_WR)
    a.setblocking(False)
    sent = 0
    try:
        while sent < len(PAYLOAD):
            sent += a.send(PAYLOAD[sent:])
    except BlockingIOError:
        pass
    a.setblocking(True)
    a.shutdown(socket.SHUT_WR)
elif state == "time_wait":
    a.close()
    b.close()
else:
    raise SystemExit(f"unknown state {state}")
time.sleep(0.2)
print("ready", flush=True)
for step in range(steps):
    print(f"step {step}", flush=True)
    time.sleep(interval)
if state == "reset":
    try:
        data = a.recv(1)
        print("reset socket:", "eof" if data == b"" else "data", flush=True)
    except OSError:
        print("reset socket: eof", flush=True)  # ECONNRESET once, then EOF: the same to us
elif state == "halfclosed":
    print("a reads:", read_all(a), flush=True)
    a.sendall(b"after the half-close")
    a.shutdown(socket.SHUT_WR)
    print("b reads:", read_all(b), flush=True)
elif state in ("fin_wait1", "last_ack"):
    got = read_all(b)
    print("b reads:", len(got), hashlib.sha256(got).hexdigest()[:16], flush=True)
    if state == "fin_wait1":
        b.shutdown(socket.SHUT_WR)
    print("a reads:", read_all(a), flush=True)
print("done", flush=True)
