"""Runs restart_trainer.py under torchrun with --max_restarts 2 (2 processes)
and passes if the last attempt's ranks printed their OK lines after both
kills (attempts 0 and 1 each lose rank 1 to SIGKILL).

    run_restarts.py [--python PY] [--env K=V ...] -- TRAINER_ARGS...

The checkpoint directory is made fresh here; --monitor_interval 0.2 lets
torchrun notice a dead worker quickly (its default polls every 5 s).
"""

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_torchrun import free_port, run_logged, worker_env  # noqa: E402

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_trainer.py")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable,
                   help="runs torchrun and the workers (default: this interpreter)")
    p.add_argument("--env", action="append", default=[], help="K=V for torchrun and the workers")
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("trainer", nargs=argparse.REMAINDER)
    args = p.parse_args()
    env = worker_env(args.env, SF_TIMEOUT_MS="60000")
    with tempfile.TemporaryDirectory(prefix="sfsync-restart-") as ckpt:
        cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--max_restarts", "2", "--monitor_interval", "0.2",
               "--redirects", "2", "--tee", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), TRAINER, "--ckpt", ckpt]
        cmd += [a for a in args.trainer if a != "--"]
        proc = run_logged(cmd, env, args.timeout)
        if proc is None:
            return 1
    print(proc.stdout)
    ok = [r for r in range(2) if re.search(r"\[rank %d\] OK " % r, proc.stdout)]
    kills = re.findall(r"attempt (\d): SIGKILL myself", proc.stdout)
    if proc.returncode != 0 or len(ok) != 2 or kills != ["0", "1"]:
        print("FAILED: torchrun exit %d, OK lines from ranks %s of 2, kills in attempts %s "
              "(expected 0 and 1)" % (proc.returncode, ok, kills))
        return 1
    print("PASSED: two kills, resumed, every rank OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
