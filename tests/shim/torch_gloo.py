"""Teardown of a torch.distributed Gloo process group that cannot deadlock.

PyTorch 1.13 can hang at the end of a DDP run: the last reference to the
ProcessGroupGloo (held by DDP's Reducer) is dropped on the main thread, whose
destructor joins the group's worker threads *while holding the GIL*; a worker
may still be releasing the last reference to a Python-owned tensor of the last
collectives, which needs the GIL. Seen here about once in 75 runs, with and
without the shim (stacks: ~ProcessGroupGloo -> std::thread::join on the main
thread; ProcessGroupGloo::runLoop -> ~TensorImpl -> destroy_pyobj_if_needed ->
PyEval_AcquireThread on the worker).

Sleeping with the GIL released after the last collective lets the workers
finish before anything is destroyed.
"""

import time

import torch.distributed as dist


def shutdown():
    """Call once, after the last collective, before the DDP model goes away."""
    dist.barrier()
    time.sleep(0.2)  # releases the GIL: the Gloo workers drain their last work
    dist.destroy_process_group()
