"""Measures TCP throughput between two simulated hosts (no iperf here).

    rate_probe.py serve PORT          receive until EOF, print "BYTES SECONDS MBIT"
    rate_probe.py send ADDR PORT MB   send MB MiB
The receiver times from its first to its last byte, so connection setup and
the sender's start-up do not count.
"""
import socket
import sys
import time


def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    s.settimeout(30)
    c, _ = s.accept()
    c.settimeout(30)
    total = 0
    t0 = t1 = None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.perf_counter()
            first = len(b)
        total += len(b)
        t1 = time.perf_counter()
    secs = (t1 - t0) if t0 is not None else 0.0
    timed = total - first if t0 is not None else 0
    mbit = timed * 8 / secs / 1e6 if secs > 0 else 0.0
    print("%d %.6f %.1f" % (total, secs, mbit), flush=True)


def send(addr, port, mb):
    for _ in range(100):  # the receiver may not listen yet
        try:
            c = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("rate_probe: cannot connect to %s:%d" % (addr, port))
    chunk = b"\0" * (1 << 20)
    for _ in range(mb):
        c.sendall(chunk)
    c.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
