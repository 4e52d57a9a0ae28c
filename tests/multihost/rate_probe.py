"""Measures TCP throughput between two simulated hosts (no iperf here).

    rate_probe.py serve PORT          receive until EOF, print "BYTES SECONDS MBIT"
    rate_probe.py send ADDR PORT MB   send MB MiB
    rate_probe.py judge RATE_MBIT MEASURED_MBIT QDISC
                                      the verdict on a NIC limited to RATE_MBIT
The receiver times from its first to its last byte, so connection setup and
the sender's start-up do not count.

The verdict cannot fail by chance on a loaded machine: the limiter must be
configured as asked (tc's own `qdisc show` text, e.g. "qdisc tbf 8001: root
refcnt 2 rate 200Mbit burst 50000b lat 50ms") and the measured rate must not
exceed it by more than 15 % (a token bucket cannot be beaten, whatever the
load; its burst, 2 ms of the rate, is under 1 % of the 12 MiB sent). A loaded
machine only makes the rate lower, so there is no lower bound beyond "bytes
arrived" (an earlier version asked for 120-230 Mbit/s and could fail on a
busy machine); the measured rate is printed.
"""
import re
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


def rate_mbit(text):
    """The rate of a `tc qdisc show` line in Mbit/s, None if it has none."""
    m = re.search(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit\b", text)
    if not m:
        return None
    return float(m.group(1)) * {"": 1e-6, "K": 1e-3, "M": 1.0, "G": 1e3}[m.group(2)]


def judge(rate, measured, qdisc):
    failures = []
    configured = rate_mbit(qdisc)
    if "tbf" not in qdisc or configured is None or abs(configured - rate) > 1e-9 * rate:
        failures.append("the NIC's qdisc is not tbf at %g Mbit/s: %r" % (rate, qdisc.strip()))
    if not measured > 0:
        failures.append("no bytes were timed (%g Mbit/s)" % measured)
    if measured > 1.15 * rate:
        failures.append("measured %g Mbit/s, above the limiter's %g Mbit/s + 15 %%" % (measured, rate))
    for f in failures:
        print("FAIL: rate: " + f)
    if not failures:
        print("ok: tbf at %g Mbit/s, measured %g Mbit/s (at most %g: a limiter cannot be beaten; "
              "no lower bound, a loaded machine is slower)" % (rate, measured, 1.15 * rate))
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif sys.argv[1] == "judge":
        sys.exit(judge(float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
