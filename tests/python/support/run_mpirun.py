"""Runs a script on 2 ranks under Open MPI's mpirun the way a user does,
with a free MASTER_PORT (torch's env:// rendezvous) and the given variables
carried to the ranks with -x.

    run_mpirun.py MPIRUN [--env K=V ...] -- SCRIPT ARGS...

The ranks run this script's own interpreter. Exit status: mpirun's.
"""

import argparse
import os
import socket
import subprocess
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mpirun")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--env", action="append", default=[], help="K=V carried to the ranks")
    argv = sys.argv[1:]
    if "--" not in argv:
        p.error("-- SCRIPT ARGS... missing")
    cut = argv.index("--")
    a = p.parse_args(argv[:cut])
    script = argv[cut + 1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [a.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(a.np),
           "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=%d" % port,
           "-x", "GLOO_SOCKET_IFNAME=lo", "-x", "OMP_NUM_THREADS=1"]
    for kv in a.env + ["SFSYNC_LIBRARY=" + os.environ.get("SFSYNC_LIBRARY", "")]:
        cmd += ["-x", kv]
    cmd += [sys.executable] + script
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, timeout=150)


if __name__ == "__main__":
    sys.exit(main())
