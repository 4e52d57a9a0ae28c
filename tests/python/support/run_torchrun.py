"""Runs torchrun_trainer.py under torchrun (2 processes) the way a user
does, on a free port, and passes if every rank printed its OK line.

    run_torchrun.py [--python PY] [--shim LIB] [--env K=V ...] -- TRAINER ARGS...

torchrun is `PY -m torch.distributed.run`, PY this script's own interpreter
unless given (ctest starts it with each torch's python). Debian's torch 1.13
on Python 3.11 needs --redirects 2 --tee 2 (TOOLCHAIN.md); torch 2.x accepts
the same flags (2.15 checked); the workers print their results to stderr,
which --tee 2 shows here. --monitor_interval 0.1 (2.x's default): torch
1.13's agent looks at its workers every 5 s by default, so a
run ended up to 5 s after its workers did; the interval only sets how soon
torchrun sees their exit, not what they do or check.
--shim LIB preloads LIB into the workers only (torchrun --no_python runs
`env LD_PRELOAD=LIB PY TRAINER`): the launcher itself stays clean.
"""

import argparse
import os
import re
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(kvs, **fixed):
    """This environment with Gloo on loopback, one OpenMP thread, `fixed`,
    then the K=V strings `kvs` (which win)."""
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **fixed)
    for kv in kvs:
        k, v = kv.split("=", 1)
        env[k] = v
    return env


def run_logged(cmd, env, timeout):
    """Prints and runs cmd (stdout and stderr together, as text); None, after
    printing what it wrote and a FAILED line, if it ran past timeout seconds."""
    print("+ " + " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(e.output or "")
        print("FAILED: torchrun did not finish within %g s" % timeout)
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable,
                   help="runs torchrun and the workers (default: this interpreter)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--shim", help="LD_PRELOAD this library into the workers")
    p.add_argument("--env", action="append", default=[], help="K=V for the workers")
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--expect", default="OK", help="regex every rank must print")
    p.add_argument("trainer", nargs=argparse.REMAINDER)
    args = p.parse_args()
    trainer = [a for a in args.trainer if a != "--"]
    env = worker_env(args.env)
    cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--redirects", "2", "--tee", "2", "--monitor_interval", "0.1",
           "--master_addr", "127.0.0.1",
           "--master_port", str(free_port())]
    if args.shim:
        cmd += ["--no_python", "/usr/bin/env", "LD_PRELOAD=" + args.shim, args.python]
    cmd += trainer
    proc = run_logged(cmd, env, args.timeout)
    if proc is None:
        return 1
    print(proc.stdout)
    ok = [r for r in range(args.nproc)
          if re.search(r"\[rank %d\] %s" % (r, args.expect), proc.stdout)]
    if proc.returncode != 0 or len(ok) != args.nproc:
        print("FAILED: torchrun exit %d, OK lines from ranks %s of %d"
              % (proc.returncode, ok, args.nproc))
        return 1
    print("PASSED: torchrun exit 0, every rank OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
