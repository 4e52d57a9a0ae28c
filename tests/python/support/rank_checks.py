"""What the torchrun test scripts share (test_framework_loop_vs_ddp.py,
test_sharded_trainer.py): a rank's results on stderr (torchrun --tee 2), the
checks it failed, and the end of the run."""

import sys
import time

import torch.distributed as dist

TOL = 1e-6


def say(rank, text):
    sys.stderr.write("[rank %d] %s\n" % (rank, text))
    sys.stderr.flush()


class Checks:
    """A rank's failed checks, each said at once as a CHECK FAILED line."""

    def __init__(self, rank):
        self.rank, self.failed = rank, []

    def that(self, ok, text):
        if not ok:
            self.failed.append(text)
            say(self.rank, "CHECK FAILED: " + text)
        return ok

    def close(self, what, a, b, tol=TOL):
        """max |a - b| over the tensors of a and b, within tol."""
        diff = max(float((x.detach().double() - y.detach().double()).abs().max())
                   for x, y in zip(a, b))
        self.that(diff <= tol, "%s: max |diff| %.3g > %g" % (what, diff, tol))
        return diff

    def finish(self, done):
        """The run's end: Gloo's process group goes before the interpreter
        does (a torch 2.x process exiting with it alive can abort in a Gloo
        worker thread), the workers drain first with the GIL released (torch
        1.13's teardown); then "OK ..." or the count of failed checks.
        Returns the exit status."""
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()
        if self.failed:
            say(self.rank, "%d checks failed" % len(self.failed))
            return 1
        say(self.rank, "OK %s" % " | ".join(done))
        return 0
