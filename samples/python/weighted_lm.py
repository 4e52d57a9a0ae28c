"""Token-mean gradients of a small causal LM over whole windows and every
rank: plain DDP, the HF Trainer's fix and sfsync's weighted windows, each
against one single-process reference.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \\
      build/plugin/tools/sfsync-run -n 2 -- ~/.cache/sfsync/venv-torch2/bin/python \\
      samples/python/weighted_lm.py

(-n 3 for 3 ranks; from the root of a checkout built in build/. Any
launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT works;
torch.distributed (Gloo) meets on MASTER_PORT + 1, as the other samples.)

The model is GPT-2 built from a config in code (transformers'
``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256,
n_positions=64)``, no download, dropout off); without transformers (Debian's
torch 1.13) a tiny causal LM of the same shape of loss (``--model tiny``).
Every micro-batch holds --batch-size sequences of lengths drawn from 2 to
--seq-len (seeded per rank, window and micro-batch, with a per-micro-batch
cap so the token counts vary several-fold), right-padded, the padding
labelled -100. A micro-batch's loss counts the one-position shift: the
tokens are its shifted labels that are not -100 (``labels[:, 1:] != -100``).

Windows of --micro-batches (4) micro-batches per rank, --windows (4) AdamW
steps. Four trainings from the same initial weights, in float64 and again
in float32 (--dtypes):

* reference  one process, no communication: each window's data of every
             rank and micro-batch as ONE batch, loss = sum of the per-token
             losses / the window's tokens (the token mean). Every rank
             computes it alike.
* ddp        plain DDP, per-micro-batch means: loss = sum / that
             micro-batch's tokens / N, ``no_sync()`` around forward and
             backward of micro-batches 1..N-1 (the usual gradient
             accumulation; DDP averages over the ranks). The mean of means
             is not the window's token mean.
* hf         the HF Trainer's fix, written out with torch.distributed: it
             looks at all N micro-batches of the window before the first
             forward and counts their tokens (transformers'
             ``Trainer.get_batch_samples`` -> ``_get_num_items_in_batch``,
             which counts ``labels[..., 1:]`` for causal-LM losses), sums
             that count over the ranks with one collective per step
             (``average_tokens_across_devices=True``: transformers does it
             with ``accelerator.gather(...).sum()``, here an all_reduce of
             the int64 count: the same one collective), and each
             micro-batch's loss is sum / global count * world size (the
             model's loss with ``num_items_in_batch``, times
             ``num_processes`` in ``compute_loss``, no division by N), DDP
             averaging over the ranks as above.
* sfsync     ``GradientSync(model, reduce="weighted")``: loss = the plain
             sum, ``sync.weigh(tokens)`` once per micro-batch before its
             backward, ``sync.no_sync()`` around micro-batches 1..N-1. The
             global weight rides in the buckets' own collectives; the
             window's loss and token sums ride along too
             (``sync.add_window_sums``, read with ``sync.window_sums()``).

Reported per variant (rank 0 prints the table; every number is the largest
over the ranks):

* ``f64 |w-ref|``: max |weights - reference's| after the last step, float64.
* ``f32 |w-ref|``: the same in float32 (for information: float32 weights
  after AdamW differ by summation order alone, see issue 31).
* ``f32 grad``: window 0's gradient, max |g - reference's g| over the
  largest |reference g|, float32 (before any step).
* ``coll/win``: collectives per window. DDP and hf: the torch.distributed
  calls made inside the window (every gradient all-reduce of DDP goes
  through the counting comm hook, which calls ``dist.all_reduce``; hf adds
  its count). sfsync: ``collectives_issued`` per window from its stats (one
  per bucket) plus torch.distributed calls inside the window (0).
* ``bytes/win``: payload per window and rank: the bytes of the buffers
  handed to the collectives (the gradient buckets, and hf's 8-byte count),
  not the wire bytes (a ring all-reduce sends about 2(W-1)/W of that).
  sfsync: ``bytes_reduced`` per window (the gradient buckets) + the weight's
  limbs in the buckets' reserved tails (the plugin's LimbCodec: ``limbs``
  elements of the bucket's dtype per bucket, 5x in bucket 0, which also
  carries the 4 window sums), computed here from the bucket dtypes and the
  world size; the window check that every sfsync window carries in the same
  tails (weighted or not) is not counted.

Exits 1 (with ``CHECK FAILED`` lines) unless: sfsync's float64 weights are
within --tol64 (1e-9) of the reference's, and the hf fix's too; sfsync's
float32 window-0 gradient is within --tol-grad (1e-5) relative; plain DDP's
float64 weight difference and float32 gradient difference are each more
than --min-ratio (10) times sfsync's; sfsync's collectives per window equal
its bucket count, with no torch.distributed call inside its windows; and
its window sums give the reference's token count.

``--shard``: sfsync with ``shard_optimizer=True`` and
``sync.optimizer(AdamW)`` (reduce-scatter, each shard divided by the same
global weight); the gradient column is then left out for sfsync (each rank
holds only its shard's gradient).
"""

import argparse
import contextlib
import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_common as common  # noqa: E402

VARIANTS = ("ddp", "hf", "sfsync")
PAD = 0


def have_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=4, help="windows = AdamW steps (k)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per window (N)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=32, help="longest sequence (padded to it)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--model", choices=("auto", "gpt2", "tiny"), default="auto",
                   help="gpt2 (transformers) or a tiny causal LM; auto: gpt2 when "
                        "transformers imports")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--dtypes", nargs="+", default=["float64", "float32"],
                   choices=("float64", "float32"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="sfsync's and DDP's bucket cap in MiB (default: each its own, 25; the "
                        "model's gradients are one bucket; e.g. 0.1 for several)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=None,
                   help="sfsync's first bucket cap in MiB (default: its own, 1)")
    p.add_argument("--shard", action="store_true",
                   help="sfsync with shard_optimizer=True and sync.optimizer(AdamW)")
    p.add_argument("--tol64", type=float, default=1e-9,
                   help="float64: max |weights - reference| allowed (sfsync and hf)")
    p.add_argument("--tol-grad", type=float, default=1e-5,
                   help="float32: window 0's max |g - g_ref| / max |g_ref| allowed (sfsync)")
    p.add_argument("--min-ratio", type=float, default=10.0,
                   help="plain DDP's difference must exceed sfsync's by this factor")
    p.add_argument("--torch-port-offset", type=int, default=1,
                   help="torch.distributed uses MASTER_PORT + this")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    a = p.parse_args(argv)
    if a.model == "auto":
        a.model = "gpt2" if have_transformers() else "tiny"
    if a.windows < 1 or a.micro_batches < 1:
        p.error("--windows and --micro-batches must be at least 1")
    if a.seq_len < 3:
        p.error("--seq-len must be at least 3")
    return a


# ---- model and data ------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """A causal LM without transformers: token + position embeddings, a
    causal running mean over the positions, a tanh MLP, a head tied to the
    token embedding."""

    def __init__(self, vocab, n_embd, n_positions):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, n_embd)
        self.wpe = torch.nn.Embedding(n_positions, n_embd)
        self.fc = torch.nn.Linear(n_embd, 4 * n_embd)
        self.proj = torch.nn.Linear(4 * n_embd, n_embd)
        self.ln = torch.nn.LayerNorm(n_embd)
        for emb in (self.wte, self.wpe):
            torch.nn.init.normal_(emb.weight, std=0.02)  # (GPT-2's initializer range)

    def forward(self, input_ids, attention_mask=None):
        t = input_ids.shape[1]
        h = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))
        steps = torch.arange(1, t + 1, device=h.device, dtype=h.dtype).reshape(1, t, 1)
        h = h + h.cumsum(1) / steps  # position i sees positions <= i only
        h = h + self.proj(torch.tanh(self.fc(h)))
        return self.ln(h) @ self.wte.weight.t()


def build_lm(a, dtype):
    """The model, initialized from --seed (every rank and copy alike)."""
    torch.manual_seed(a.seed)
    if a.model == "gpt2":
        import transformers
        cfg = transformers.GPT2Config(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                                      vocab_size=a.vocab, n_positions=max(64, a.seq_len),
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        model = TinyLM(a.vocab, a.n_embd, max(64, a.seq_len))
    return model.to(dtype).train()


class Batch:
    def __init__(self, ids, mask, labels):
        self.ids, self.mask, self.labels = ids, mask, labels

    def tokens(self):
        """The tokens its loss counts: shifted labels that are not -100."""
        return int((self.labels[:, 1:] != -100).sum())


def micro_batch(a, rank, window, micro):
    """Deterministic per (rank, window, micro-batch): every rank can make
    every other rank's (the reference does). Sequences are arithmetic runs
    modulo the vocabulary with some noise (learnable), of lengths 2..cap,
    cap drawn per micro-batch from 3..seq_len: token counts vary several-fold
    between micro-batches."""
    g = torch.Generator().manual_seed(((a.seed * 1000003 + rank) * 10007 + window) * 101 + micro)
    b, t = a.batch_size, a.seq_len
    cap = int(torch.randint(3, t + 1, (1,), generator=g))
    lengths = torch.randint(2, cap + 1, (b, 1), generator=g)
    start = torch.randint(0, a.vocab, (b, 1), generator=g)
    step = torch.randint(1, 8, (b, 1), generator=g)
    ids = (start + step * torch.arange(t)) % a.vocab
    noise = torch.rand(b, t, generator=g) < 0.1
    ids = torch.where(noise, torch.randint(0, a.vocab, (b, t), generator=g), ids)
    mask = torch.arange(t).reshape(1, t) < lengths
    ids = torch.where(mask, ids, torch.full_like(ids, PAD))
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return Batch(ids, mask.long(), labels)


def window_batches(a, world, window):
    """[rank][micro] batches of one window."""
    return [[micro_batch(a, r, window, m) for m in range(a.micro_batches)] for r in range(world)]


def concat(batches):
    return Batch(torch.cat([b.ids for b in batches]), torch.cat([b.mask for b in batches]),
                 torch.cat([b.labels for b in batches]))


def loss_sum(module, b):
    """(sum of the per-token losses, tokens) with the one-position shift."""
    out = module(input_ids=b.ids, attention_mask=b.mask)
    logits = out.logits if hasattr(out, "logits") else out
    vocab = logits.shape[-1]
    s = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), b.labels[:, 1:].reshape(-1),
                        ignore_index=-100, reduction="sum")
    return s, b.tokens()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def grads_of(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def grad_rel_diff(grads, ref):
    """max |g - g_ref| / max |g_ref| over every parameter."""
    worst = max((g - r).abs().max().item() for g, r in zip(grads, ref) if r is not None)
    scale = max(r.abs().max().item() for r in ref if r is not None)
    return worst / scale


# ---- counting what goes to torch.distributed -----------------------------------------


class DistCalls:
    """Counts the calls of torch.distributed's collective functions (and the
    bytes of the tensors handed to them) while installed. DDP's gradient
    all-reduces go through ddp_common.counting_allreduce_hook's
    ``dist.all_reduce``, so they are counted here too."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter",
             "all_to_all", "all_to_all_single", "barrier")

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self.saved = {}
        for name in self.NAMES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue

            def wrapped(*args, _orig=orig, **kw):
                self.calls += 1
                t = args[0] if args else kw.get("tensor")
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
                return _orig(*args, **kw)

            self.saved[name] = orig
            setattr(dist, name, wrapped)

    def snapshot(self):
        return self.calls, self.bytes

    def restore(self):
        for name, orig in self.saved.items():
            setattr(dist, name, orig)
        self.saved = {}


# ---- the trainings -------------------------------------------------------------------


def adamw(a, params):
    return torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)


class Reference:
    """One process: the window's data of every rank and micro-batch as one
    batch, token-mean loss."""

    name = "reference"

    def __init__(self, a, base):
        self.model = common.clone_model(base)
        self.opt = adamw(a, self.model.parameters())
        self.last_loss = None

    def run_window(self, all_batches, keep_grads=False):
        big = concat([b for rank in all_batches for b in rank])
        s, n = loss_sum(self.model, big)
        (s / n).backward()
        self.last_loss, self.last_tokens = s.item() / n, n
        grads = grads_of(self.model) if keep_grads else None
        self.opt.step()
        self.opt.zero_grad()
        return grads

    def weights(self):
        return flat_params(self.model)

    def close(self):
        pass


class DDPVariant:
    """plain DDP (per-micro-batch means) or the HF Trainer's fix (hf)."""

    def __init__(self, name, a, base, world, count_hook=True):
        self.name, self.a, self.world = name, a, world
        self.ddp = DDP(common.clone_model(base), bucket_cap_mb=a.bucket_cap_mb or 25.0)
        if count_hook:  # (the benchmark times DDP's own C++ all-reduce instead)
            self.ddp.register_comm_hook(common.CommCounter(), common.counting_allreduce_hook)
        self.opt = adamw(a, self.ddp.parameters())
        self.count_s = []  # hf: seconds of each window's count all_reduce

    def run_window(self, batches, keep_grads=False, clock=None):
        n = len(batches)
        if self.name == "hf":
            # Before the first forward: every micro-batch of the window,
            # counted; then the count of every rank (one collective per step).
            count = torch.tensor([sum(b.tokens() for b in batches)], dtype=torch.int64)
            t0 = clock() if clock else 0.0
            dist.all_reduce(count)
            if clock:
                self.count_s.append(clock() - t0)
            scale = self.world / float(count.item())
        for m, b in enumerate(batches):
            ctx = self.ddp.no_sync() if m < n - 1 else contextlib.nullcontext()
            with ctx:
                s, tokens = loss_sum(self.ddp, b)
                if self.name == "hf":
                    (s * scale).backward()
                else:
                    (s / tokens / n).backward()
        grads = grads_of(self.ddp.module) if keep_grads else None
        self.opt.step()
        self.opt.zero_grad()
        return grads

    def weights(self):
        return flat_params(self.ddp.module)

    def close(self):
        pass


def limb_bytes(buckets, world, sharded=False):
    """Bytes of the weight's limbs in the buckets' reserved tails per window
    (plugin/core/limb_codec.cpp, LimbCodec::forWire; plugin/reducer/
    window_totals.cpp: bucket 0 carries the weight and the 4 window sums;
    sharded, every one of the world's segments has its tail)."""
    import sfsync
    exact = {sfsync.DTYPE_FLOAT64: (53, 8), sfsync.DTYPE_FLOAT32: (24, 4)}
    if world <= 1:
        return 0
    spread = max(0, math.ceil(math.log2(world)))
    total = 0
    for i, b in enumerate(buckets):
        m, esize = exact[b["dtype"]]
        bits = min(48, m - spread)
        limbs = -(-(52 + 32 + spread + 1) // bits)
        total += limbs * (5 if i == 0 else 1) * esize
    return total * (world if sharded else 1)


class SfsyncVariant:
    """GradientSync(reduce="weighted"): plain sums, sync.weigh per micro-batch."""

    name = "sfsync"

    def __init__(self, a, base, world, reduce="weighted"):
        from sfsync import torch as sft
        self.a, self.world, self.weighted = a, world, reduce == "weighted"
        self.model = common.clone_model(base)
        self.sync = sft.GradientSync(self.model, reduce=reduce, find_unused_parameters=False,
                                     bucket_cap_mb=a.bucket_cap_mb,
                                     first_bucket_cap_mb=a.first_bucket_cap_mb,
                                     shard_optimizer=a.shard)
        if a.shard:
            self.opt = self.sync.optimizer(torch.optim.AdamW, self.model.parameters(), lr=a.lr,
                                           weight_decay=a.weight_decay)
        else:
            self.opt = adamw(a, self.model.parameters())
        self.buckets = self.sync.buckets()
        self.window_sums = []

    def stats(self):
        if self.a.shard:
            from sfsync import shard
            return shard.stats(self.sync.context)
        return self.sync.stats()

    def run_window(self, batches, keep_grads=False):
        n = len(batches)
        for m, b in enumerate(batches):
            ctx = self.sync.no_sync() if m < n - 1 else contextlib.nullcontext()
            with ctx:
                s, tokens = loss_sum(self.sync, b)
                if self.weighted:
                    self.sync.weigh(tokens)  # before this micro-batch's backward
                    self.sync.add_window_sums(loss=s, tokens=tokens)
                    s.backward()
                else:  # (the benchmark's unweighted sfsync: DDP's per-micro-batch means)
                    (s / tokens / n).backward()
        if not self.sync.is_step():
            raise RuntimeError("sfsync: the window's last backward did not synchronize")
        if self.weighted:
            self.window_sums.append(self.sync.window_sums())
        grads = grads_of(self.model) if keep_grads and not self.a.shard else None
        self.opt.step()
        self.opt.zero_grad()
        return grads

    def weights(self):
        if self.a.shard:
            self.opt.wait_parameters()
        return flat_params(self.model)

    def close(self):
        self.sync.close()


# ---- one run: a dtype, every variant -------------------------------------------------


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def max_all(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_dtype(a, dtype, rank, world, failures):
    """Trains the reference and every variant in `dtype`, window by window
    on the same data. Returns ({variant: {"w_diff", "grad_rel", "coll",
    "bytes", "ranks_diff"}}, {"ref_update", "ref_loss", "tokens"}); the
    numbers are the largest over the ranks."""
    name = dtype_name(dtype)
    base = build_lm(a, dtype)
    start = flat_params(base)
    calls = DistCalls()
    variants = []
    try:
        ref = Reference(a, base)
        for v in a.variants:
            variants.append(SfsyncVariant(a, base, world) if v == "sfsync"
                            else DDPVariant(v, a, base, world))
        per = {v.name: {"coll": [], "bytes": []} for v in variants}
        grads0, g_ref0, tokens, ref_loss = {}, None, [], []
        for w in range(a.windows):
            data = window_batches(a, world, w)
            g = ref.run_window(data, keep_grads=w == 0)
            if w == 0:
                g_ref0 = g
            ref_loss.append(ref.last_loss)
            tokens.append([[b.tokens() for b in mb] for mb in data])
            for v in variants:
                dist.barrier()
                c0 = calls.snapshot()
                s0 = v.stats() if v.name == "sfsync" else None
                g = v.run_window(data[rank], keep_grads=w == 0)
                c1 = calls.snapshot()
                if w == 0:
                    grads0[v.name] = g
                d_calls, d_bytes = c1[0] - c0[0], c1[1] - c0[1]
                if v.name != "sfsync":
                    per[v.name]["coll"].append(d_calls)
                    per[v.name]["bytes"].append(d_bytes)
                    continue
                s1 = v.stats()
                coll = s1["collectives_issued"] - s0["collectives_issued"]
                nbytes = s1["bytes_reduced"] - s0["bytes_reduced"]
                per[v.name]["coll"].append(coll + d_calls)
                limbs = limb_bytes(v.buckets, world, a.shard)
                per[v.name]["bytes"].append(nbytes + limbs + d_bytes)
                if coll != s1["bucket_count"] or d_calls:
                    failures.append("%s window %d: sfsync issued %d collectives and %d "
                                    "torch.distributed calls, expected %d (one per bucket) and 0"
                                    % (name, w, coll, d_calls, s1["bucket_count"]))
                sums = v.window_sums[-1]
                if sums["tokens"] != ref.last_tokens or sums["weight"] != ref.last_tokens:
                    failures.append("%s window %d: sfsync's window sums say %s tokens and "
                                    "weight %s; the reference counted %d"
                                    % (name, w, sums["tokens"], sums["weight"], ref.last_tokens))
                loss = sums["loss"] / sums["tokens"]
                if abs(loss - ref.last_loss) > 1e-4 * abs(ref.last_loss):
                    failures.append("%s window %d: sfsync's window sums give a token-mean loss "
                                    "of %.9g, the reference %.9g" % (name, w, loss, ref.last_loss))
        out = {}
        ref_w = ref.weights()
        for v in variants:
            mine = v.weights()
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            g = grads0.get(v.name)
            out[v.name] = {
                "w_diff": max_all((mine - ref_w).abs().max().item()),
                "grad_rel": None if g is None else max_all(grad_rel_diff(g, g_ref0)),
                "ranks_diff": max((x - parts[0]).abs().max().item() for x in parts),
                "coll": per[v.name]["coll"],
                "bytes": per[v.name]["bytes"],
            }
            if v.name == "sfsync":
                st = v.stats()
                out[v.name]["buckets"] = st["bucket_count"]
                out[v.name]["bytes_reduced"] = (st["bytes_reduced"] // a.windows)
                out[v.name]["limb_bytes"] = limb_bytes(v.buckets, world, a.shard)
        info = {"ref_update": (ref_w - start).abs().max().item(),
                "ref_loss": ref_loss,
                "tokens": tokens, "parameters": start.numel(),
                "gradient_bytes": start.numel() * start.element_size()}
        return out, info
    finally:
        for v in variants:
            v.close()
        calls.restore()


# ---- the report ----------------------------------------------------------------------


def fmt(x, spec="%.2e"):
    return "-" if x is None else spec % x


def counts(xs, spec="{}"):
    """Per-window values: "n" when every window had n, else "a (window 0), then b"
    (DDP builds its buckets anew after its first window)."""
    f = spec.format
    if len(set(xs)) == 1:
        return f(xs[0])
    if len(set(xs[1:])) == 1:
        return "%s (window 0), then %s" % (f(xs[0]), f(xs[1]))
    return "/".join(f(x) for x in xs)


def report(a, world, results, infos):
    """The table (rank 0)."""
    lines = []
    info = infos[a.dtypes[0]]
    tok = info["tokens"]
    per_micro = [t for win in tok for r in win for t in r]
    model = ("GPT2LMHeadModel (%d layers, %d heads, " % (a.n_layer, a.n_head)
             if a.model == "gpt2" else "TinyLM (no transformers: ")
    lines.append("weighted_lm: %sn_embd %d, vocab %d), %d parameters; %d ranks, windows of %d "
                 "micro-batches x %d sequences (lengths 2..%d), %d AdamW steps (lr %g)"
                 % (model, a.n_embd, a.vocab, info["parameters"], world, a.micro_batches,
                    a.batch_size, a.seq_len, a.windows, a.lr))
    lines.append("tokens per micro-batch (shifted labels != -100): %d..%d; window 0 per rank: %s "
                 "(global %d)" % (min(per_micro), max(per_micro),
                                  ", ".join(str(sum(r)) for r in tok[0]),
                                  sum(sum(r) for r in tok[0])))
    for dt in a.dtypes:
        lines.append("%s: the reference's own update after %d steps: max |w_k - w_0| = %.2e; "
                     "its token-mean loss %.4f (window 0) -> %.4f (window %d)"
                     % (dt, a.windows, infos[dt]["ref_update"], infos[dt]["ref_loss"][0],
                        infos[dt]["ref_loss"][-1], a.windows - 1))
    head = ("| variant | f64 max|w-ref| | f32 max|w-ref| | f32 grad diff / max|g| (window 0) "
            "| collectives / window | bytes / window |")
    lines += [head, "|---|---:|---:|---:|---:|---:|"]
    for v in a.variants:
        r64 = results.get("float64", {}).get(v)
        r32 = results.get("float32", {}).get(v)
        label = {"ddp": "plain DDP (per-micro-batch means)",
                 "hf": "HF fix (count ahead + all_reduce)",
                 "sfsync": "sfsync weighted%s" % (" (sharded)" if a.shard else "")}[v]
        per_dt = [counts(results[dt][v]["coll"]) + (
            " (%d bucket%s)" % (results[dt][v]["buckets"], "s"[:results[dt][v]["buckets"] - 1])
            if v == "sfsync" else "") for dt in a.dtypes]
        coll = per_dt[0] if len(set(per_dt)) == 1 else "; ".join(
            "f%s %s" % (dt[5:], c) for dt, c in zip(a.dtypes, per_dt))
        nb = "; ".join("f%s %s" % (dt[5:], counts(results[dt][v]["bytes"], "{:,}"))
                       for dt in a.dtypes)
        if v == "sfsync":
            nb += " (limbs: %s)" % "; ".join(
                "f%s %d" % (dt[5:], results[dt][v]["limb_bytes"]) for dt in a.dtypes)
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            label, fmt(r64 and r64["w_diff"]), fmt(r32 and r32["w_diff"]),
            fmt(r32 and r32["grad_rel"]), coll, nb))
    return "\n".join(lines)


def checks(a, results):
    """The sample's pass/fail rules (see the module docstring)."""
    fails = []
    r64, r32 = results.get("float64", {}), results.get("float32", {})
    if "sfsync" in r64:
        d = r64["sfsync"]["w_diff"]
        if not d <= a.tol64:
            fails.append("float64: sfsync is %.3g from the reference (tolerance %g)" % (d, a.tol64))
        if "ddp" in r64 and not r64["ddp"]["w_diff"] > a.min_ratio * d:
            fails.append("float64: plain DDP is %.3g from the reference, not more than %g x "
                         "sfsync's %.3g" % (r64["ddp"]["w_diff"], a.min_ratio, d))
    if "hf" in r64 and not r64["hf"]["w_diff"] <= a.tol64:
        fails.append("float64: the HF fix is %.3g from the reference (tolerance %g)"
                     % (r64["hf"]["w_diff"], a.tol64))
    if "sfsync" in r32 and r32["sfsync"]["grad_rel"] is not None:
        d = r32["sfsync"]["grad_rel"]
        if not d <= a.tol_grad:
            fails.append("float32: sfsync's window-0 gradient is %.3g (relative) from the "
                         "reference's (tolerance %g)" % (d, a.tol_grad))
        if "ddp" in r32 and not r32["ddp"]["grad_rel"] > a.min_ratio * d:
            fails.append("float32: plain DDP's window-0 gradient is %.3g from the reference's, "
                         "not more than %g x sfsync's %.3g"
                         % (r32["ddp"]["grad_rel"], a.min_ratio, d))
    for dt, res in results.items():
        for v, r in res.items():
            if r["ranks_diff"] != 0:
                fails.append("%s: %s's weights differ across ranks by %.3g" % (dt, v,
                                                                               r["ranks_diff"]))
    return fails


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    rank, world = common.init_torch_distributed(a.torch_port_offset)
    failures, results, infos = [], {}, {}
    for dt in a.dtypes:
        results[dt], infos[dt] = run_dtype(a, getattr(torch, dt), rank, world, failures)
    failures += checks(a, results) if rank == 0 else []
    for f in failures:
        print("CHECK FAILED (rank %d): %s" % (rank, f), flush=True)
    failed = torch.tensor([len(failures)], dtype=torch.int64)
    dist.all_reduce(failed)
    if rank == 0:
        print(report(a, world, results, infos), flush=True)
        print("JSON " + json.dumps({"world_size": world, "model": a.model, "shard": a.shard,
                                    "windows": a.windows, "micro_batches": a.micro_batches,
                                    "results": results}, sort_keys=True), flush=True)
        print("ALL RANKS OK" if failed.item() == 0
              else "FAILED: %d check(s) failed across ranks" % failed.item(), flush=True)
    common.shutdown()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
