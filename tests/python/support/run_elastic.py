"""A sharded run that resumes on more nodes (issue 32): a job of two
``torchrun --nnodes=2:3 --nproc_per_node=1`` agents on a c10d rendezvous
runs elastic_trainer.py at world 2 and stops after window S (its
checkpoint written), then a job of three agents resumes it at world 3.
Passes if every agent exits 0 and the 3 ranks each printed their OK line.

(Growing one job in flight, a third agent joining the running two, times out
in torch 2.15's own agent on this machine, with a plain script as the worker
too: the agents of the new round wait 60 s for each other's role_info /
MASTER_ADDR keys. So the change of size is made by a relaunch, as after a
preemption.)

    run_elastic.py [--timeout S]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_torchrun import free_port, worker_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def agent(port, ckpt, log, stop):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3",
           "--nproc_per_node", "1", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "127.0.0.1:%d" % port, "--rdzv_id", "sfsync-elastic",
           "--rdzv_conf", "last_call_timeout=1,join_timeout=60",
           "--max_restarts", "0", "--monitor_interval", "0.1", "--redirects", "2", "--tee", "2",
           os.path.join(HERE, "elastic_trainer.py"), "--ckpt", ckpt] + (["--stop"] if stop else [])
    return subprocess.Popen(cmd, env=worker_env([]), stdout=log, stderr=subprocess.STDOUT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args()
    ckpt = tempfile.mkdtemp(prefix="sfsync-elastic-")
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(5)]
    deadline = time.time() + args.timeout
    codes = []
    agents = []
    for size, stop in ((2, True), (3, False)):
        port = free_port()
        job = [agent(port, ckpt, logs[len(agents) + i], stop) for i in range(size)]
        for a in job:
            try:
                codes.append(a.wait(timeout=max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                a.kill()
                codes.append("timeout")
        agents += job
    text = ""
    for i, log in enumerate(logs[:len(agents)]):
        log.seek(0)
        out = log.read()
        text += out
        print("---- agent %d (exit %s)\n%s" % (i, codes[i], out[-6000:]))
    shutil.rmtree(ckpt, ignore_errors=True)
    oks = sorted(set(re.findall(r"\[rank (\d)\] OK 2 -> 3", text)))
    if codes == [0] * 5 and oks == ["0", "1", "2"] and "CHECK FAILED" not in text:
        print("PASSED: 2 -> 3 ranks, every rank OK")
        return 0
    print("FAILED: agents exited %s, OK lines from ranks %s" % (codes, oks))
    return 1


if __name__ == "__main__":
    sys.exit(main())
