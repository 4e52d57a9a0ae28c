"""A sharded trainer that resumes at another world size (run by
run_elastic.py: ``torchrun --nnodes=2:3`` agents, one process each: a job
of 2 that stops after window S, then a job of 3 from its checkpoint).

Every window it checkpoints the README's way (every rank
``sfsync.torch.consolidate_state_dict(opt)``, rank 0 writes {model,
optimizer, sync} atomically) and resumes from the checkpoint when one
exists, at whatever world size the launcher gave; ``--stop`` ends the run
after window S, as a preemption would. Each
window's global batch (G samples) is split over the ranks, the loss scaled
W / G, so the run at 3 ranks continues the 2-rank one: the end must equal a
one-process AdamW over the same global batches (1e-6), and sfsync's window
count must have gone on. One "[rank r] OK" line per rank at the end, or
"CHECK FAILED" lines.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import sfsync.torch as sft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sfsync",
                                "torch"))  # test_checkpoint
import test_checkpoint as tc  # noqa: E402  (the model, the data, the reference)


def say(text):
    sys.stderr.write("[rank %s] %s\n" % (os.environ.get("RANK", "?"), text))
    sys.stderr.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True, help="a directory shared by the ranks")
    p.add_argument("--stop", action="store_true", help="stop after window S")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.ckpt, "ckpt.pt")
    saved = torch.load(path) if os.path.exists(path) else None
    start = saved["windows"] if saved else 0
    say("world %d, %s" % (world, "resuming at window %d" % start if saved else "starting"))
    model = tc.Net(5 if saved else 0)  # (a resumed run must take the saved weights)
    sync = sft.GradientSync(model, shard_optimizer=True)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=tc.LR, weight_decay=0.1)
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        sync.load_state_dict(saved["sync"])
    trainer = tc.World.__new__(tc.World)  # (its train() over the launcher's world)
    trainer.w, trainer.rank = world, rank
    for w in range(start, tc.K):
        trainer.train(model, sync, opt, [w])
        sft.consolidate_state_dict(opt)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "sync": sync.state_dict(), "windows": w + 1, "world": world},
                       path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
        if args.stop and w + 1 == tc.S:
            say("window %d checkpointed at world %d: stopping" % (tc.S, world))
            return finish(sync, 0)
    ref = tc.reference()
    failures = []
    diff = float((tc.flat(model) - tc.flat(ref)).abs().max())
    if not diff <= 1e-6:
        failures.append("weights vs a one-process AdamW: max |diff| %.3g" % diff)
    if world != 3 or start != tc.S:
        failures.append("ended at world %d resumed at window %d, expected world 3 from "
                        "window %d" % (world, start, tc.S))
    if sync.windows != tc.K:
        failures.append("sfsync windows %d, expected %d" % (sync.windows, tc.K))
    for f in failures:
        say("CHECK FAILED " + f)
    if not failures:
        say("OK 2 -> 3 ranks at window %d under an elastic torchrun: max |diff| %.3g vs "
            "one process, windows %d" % (start, diff, sync.windows))
    return finish(sync, 1 if failures else 0)


def finish(sync, code):
    sync.close()
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
