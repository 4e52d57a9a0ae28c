"""PyTorch integration of sfsync: gradients synchronized exactly once per
gradient-accumulation window, in a trainer launched by torchrun or not.

Two ways in, one line each:

``GradientSync(model, accumulation_steps=N)`` replaces DDP. It counts the
backward passes itself: the loop stays ::

    sync = sfsync.torch.GradientSync(model, accumulation_steps=4)
    for x, y in loader:
        (loss_fn(model(x), y) / 4).backward()     # loss scaling: yours, explicit
        if sync.is_step():                        # the 4th pass synchronized
            opt.step()
            opt.zero_grad()

``attach(ddp_model, accumulation_steps=N)`` keeps DDP: it registers a DDP
communication hook bound to sfsync's window state. Inside a window a bucket is
returned locally (nothing is sent); outside it is averaged with the process
group's all-reduce, as DDP's default. Same loop, no ``no_sync()``.

Both also follow the host's own windows instead of counting, as the
trainer frameworks drive DDP: ``with sync.no_sync():`` (GradientSync, or
DDP's own ``ddp.no_sync()`` under attach) around forward and backward of
micro-batches 1..N-1, and the first pass outside synchronizes at its end
(sfsync/host_window.py: the rule between the host and a counter). Both take
``verify_every=K``: every K optimizer steps (windows) the ranks compare a
digest of their parameters (``verify_buffers=True``: and buffers) with one
8-byte collective, and a mismatch raises ``ReplicaMismatchError`` on every
rank naming the first differing tensor (found by a second round). A check
costs one pass over the weights' bytes (1-3 ms per 10 MB measured here) plus
one small collective; K = 100 costs nothing measurable, K = 1 is for
debugging.

Per-token loss over whole windows (0.4): ``GradientSync(model,
reduce="weighted")``, a summed loss and ``sync.weigh(tokens)`` per
micro-batch give every rank the window's token-mean gradient, the divisor
travelling with the gradients (no extra collective); ``sync.window_sums()``
returns the window's loss and token sums the same way (``weighted``).

Where sfsync meets its peers (the rule, see ``make_context``):

1. ``torch.distributed`` initialized: through torch's own store
   (``_get_default_store()``) under a key prefix per context: no port of its
   own, nothing to collide with torchrun's.
2. else under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): through a
   client of torchrun's store on ``MASTER_ADDR:MASTER_PORT``.
3. else: sfsync's own ``env://`` store on ``MASTER_PORT`` (e.g. ``sfsync-run``),
   or whatever ``SF_RENDEZVOUS`` says. Initialize torch.distributed first if
   you use both.

The context connects when attached (``sf_connect``), so a wrong world size or
an unreachable store is an error there, not inside a backward pass. Initial
parameters and buffers are broadcast from rank 0 at attach (``sf_broadcast``),
as DDP does.

Logging goes through sfsync's logger (``SF_DEBUG=INFO`` shows each attach).

The package, one module per concern (each says what it owns and what not):
``store`` (the flat gradient/parameter stores, every pointer and device
decision), ``verify`` (replica checks), ``face`` (what every host face
shares: the HostWindow, no_sync, the face's state dict), ``gradient_sync``
(GradientSync), ``window_driver`` (the one sequence of a window's
collectives, which GradientSync and the optimizer each call), ``ddp``
(attach, DDPSync, the comm hook), ``optim`` (SyncOptimizer over a
``shard_map``; ``optim_state`` its state dicts), ``weighted`` (weigh,
window_sums), ``rendezvous``
(make_context, the c10d store), ``integrations/`` (Accelerate, Lightning,
transformers: one file each). This module only re-exports their public
names; ``sfsync.optim`` and ``sfsync.integrations`` are their 0.3 locations.
"""

from sfsync.torch.ddp import DDPSync, attach
from sfsync.torch.face import SET_TO_NONE_DEFAULT
from sfsync.torch.gradient_sync import GradientSync
from sfsync.torch.optim_state import consolidate_state_dict
from sfsync.torch.rendezvous import make_context, torch_store_callbacks
from sfsync.torch.store import sf_dtype
from sfsync.torch.verify import ReplicaCheck, ReplicaMismatchError

__all__ = ["GradientSync", "DDPSync", "attach", "consolidate_state_dict", "ReplicaCheck", "ReplicaMismatchError",
           "make_context", "sf_dtype", "SET_TO_NONE_DEFAULT"]

#: The 0.3 name of rendezvous.torch_store_callbacks (tests use it).
_torch_store_callbacks = torch_store_callbacks
