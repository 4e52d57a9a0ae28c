"""sfsync's bucket plan against PyTorch's own: GradientSync.buckets() (and the
flat buffer's layout, which says which parameter is in which bucket) must be
the buckets torch.distributed._compute_bucket_assignment_by_size makes for
the same parameters, as DDP calls it.

Like with like: DDP (torch 1.13, nn/parallel/distributed.py) builds one
bucket of everything at construction when find_unused_parameters=False
(limits [sys.maxsize]) and rebuilds the buckets after the first iteration
(Reducer::rebuild_buckets) with the parameters in the order their gradients
became ready (the reverse of registration for these models), the limits
[first_bucket_bytes, bucket_bytes_cap] and tensor_indices = their original
indices (so torch keeps the walk order instead of sorting). sfsync promises
the rebuilt plan from the start, so the oracle is that rebuild call. The one
documented difference (plugin/reducer/bucket_plan.h): sfsync's cap is strict
(no bucket takes a gradient that carries it past bucket_cap; the first: past
max(bucket_cap, first cap)), DDP checks the cap only after adding. Where a
torch bucket passes the cap, the oracle drops its last gradient and asks
torch again from there (bucket by bucket); where none does, sfsync's plan must
be torch's single call as it is.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \
        /usr/bin/python3 tests/python/sfsync/torch/test_bucket_plan_vs_torch.py -v
"""

import inspect
import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sfsync import torch as sft  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="")
MIB = 1024 * 1024


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                               torch.nn.Conv2d(32, 64, 3), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
                               torch.nn.Conv2d(64, 64, 3), torch.nn.Flatten(),
                               torch.nn.Linear(64 * 10 * 10, 100), torch.nn.Linear(100, 10))


def transformer_block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(1000, 128),
                               torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=512),
                               torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=512),
                               torch.nn.LayerNorm(128), torch.nn.Linear(128, 1000))


def mixed_dtypes():
    """float32, float64, float16 and bfloat16 parameters interleaved."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 200).double(),
                               torch.nn.Linear(200, 400).half(), torch.nn.Linear(400, 100),
                               torch.nn.Linear(100, 300).to(torch.bfloat16),
                               torch.nn.Linear(300, 50).double(), torch.nn.Linear(50, 500))


MODELS = {"mlp": mlp, "conv_net": conv_net, "transformer_block": transformer_block,
          "mixed_dtypes": mixed_dtypes}
# (bucket_cap_mb, first_bucket_cap_mb): DDP's defaults, then caps that cut
# these models into many buckets, and a first cap above the cap.
CAPS = [(25, 1), (0.25, 0.05), (0.5, 0.125), (0.04, 0.01), (0.1, 0.3), (1, 0.001)]


def ddp_caps(cap_mb, first_mb):
    """DDP's keyword arguments for buckets of first_mb, then cap_mb each.
    torch 1.13 (and 2.x before bucket_cap_mb_list) takes the first cap from
    dist._DEFAULT_FIRST_BUCKET_BYTES (the caller sets it) whatever
    bucket_cap_mb is; newer 2.x (2.15 checked) uses it only with the default
    bucket_cap_mb=None and otherwise makes the first bucket as large as the
    others: there, the per-bucket list [first, cap] (the last repeats) says
    the same, for the first bucketing and the rebuild."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        return {"bucket_cap_mb_list": [first_mb, cap_mb]}
    return {"bucket_cap_mb": cap_mb}


def torch_plan(params, cap_mb, first_mb):
    """DDP's rebuilt buckets: lists of parameter indices in packing order."""
    n = len(params)
    ready = list(reversed(range(n)))  # the backward's order for these models
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i].detach() for i in ready], [int(first_mb * MIB), int(cap_mb * MIB)],
        [False] * n, ready)
    return [list(b) for b in buckets]


def torch_plan_strict(params, cap_mb, first_mb):
    """Per dtype, in walk order: torch's next bucket from each position, less
    its last gradient where it passes the strict cap. Returns
    ({dtype: [bucket, ...]}, how many buckets the strict cap changed)."""
    cap, first = int(cap_mb * MIB), int(first_mb * MIB)
    walk = list(reversed(range(len(params))))
    plans, changed = {}, 0
    for dt in dict.fromkeys(params[i].dtype for i in walk):
        group = [i for i in walk if params[i].dtype == dt]
        out, at = [], 0
        while at < len(group):
            rest = group[at:]
            limits = [first, cap] if not out else [cap]
            # Positions in `rest` as tensor_indices (torch indexes
            # expect_sparse_gradient with them), mapped back after.
            buckets, _ = dist._compute_bucket_assignment_by_size(
                [params[i].detach() for i in rest], limits, [False] * len(rest),
                list(range(len(rest))))
            b = [rest[k] for k in buckets[0]]  # one dtype: buckets come in walk order
            if len(b) > 1 and bytes_of(params, b) > (max(cap, first) if not out else cap):
                b.pop()
                changed += 1
            out.append(b)
            at += len(b)
        plans[dt] = out
    return plans, changed


def sfsync_plan(model, cap_mb, first_mb):
    """GradientSync's buckets in synchronization order: lists of parameter
    indices in packing order, and bucket_info of each. The flat buffer is laid
    out bucket by bucket in packing order (the views are the gradients), so
    the parameters sorted by address, cut by each bucket's gradient_count,
    are the buckets; each piece must hold the bucket's bytes and dtype."""
    sync = sft.GradientSync(model, hooks=False, broadcast=False, find_unused_parameters=False,
                            bucket_cap_mb=cap_mb, first_bucket_cap_mb=first_mb, **LOCAL)
    try:
        info = sync.buckets()
        params = sync.params
        by_address = sorted(range(len(params)), key=lambda i: params[i].grad.data_ptr())
        buckets, at = [], 0
        for b in info:
            buckets.append(by_address[at:at + b["gradient_count"]])
            at += b["gradient_count"]
        assert at == len(params), (at, len(params))
        for b, members in zip(info, buckets):
            assert b["bytes"] == sum(params[i].numel() * params[i].element_size() for i in members)
            assert {sft.sf_dtype(params[i].dtype) for i in members} == {b["dtype"]}
        return buckets, info
    finally:
        sync.close()


def bytes_of(params, bucket):
    return sum(params[i].numel() * params[i].element_size() for i in bucket)


class BucketPlanVsTorch(unittest.TestCase):
    def test_same_buckets_as_ddp_for_every_model_and_cap(self):
        as_is = strict = 0
        for name, make in MODELS.items():
            for cap, first in CAPS:
                with self.subTest(model=name, cap_mb=cap, first_mb=first):
                    model = make()
                    params = [p for p in model.parameters() if p.requires_grad]
                    want, changed = torch_plan_strict(params, cap, first)
                    got, _ = sfsync_plan(model, cap, first)
                    # Each dtype's buckets, in order (torch appends the buckets
                    # still open at the end in unordered_map order, so only the
                    # order within a dtype is torch's).
                    for dt, buckets in want.items():
                        self.assertEqual([b for b in got if params[b[0]].dtype == dt], buckets, str(dt))
                    # sfsync's order across dtypes: by the walk position of each
                    # bucket's last gradient (its own rule; one dtype: torch's).
                    ends = [len(params) - 1 - b[-1] for b in got]
                    self.assertEqual(ends, sorted(ends))
                    if changed == 0:
                        as_is += 1
                        whole = torch_plan(params, cap, first)
                        if len(want) == 1:
                            self.assertEqual(got, whole)
                        else:
                            self.assertEqual(sorted(got), sorted(whole))
                    else:
                        strict += 1
                    print("%s cap %s first %s: %d buckets, as torch's%s" % (
                        name, cap, first, len(got),
                        " (%d shortened by the strict cap)" % changed if changed else ""))
        # Not vacuous: both kinds, with DDP's defaults compared as they are.
        self.assertGreaterEqual(as_is, 4)
        self.assertGreaterEqual(strict, 10)

    def test_ddp_defaults_split_the_mlp_where_torch_does(self):
        # DDP's defaults (25 MB, 1 MB first): the last layers until the 1 MiB
        # 512x512 weight closes the first bucket, then the rest.
        model = mlp()
        params = list(model.parameters())
        want = torch_plan(params, 25, 1)
        self.assertEqual(want, [[5, 4, 3, 2], [1, 0]])
        got, info = sfsync_plan(model, 25, 1)
        self.assertEqual(got, want)
        self.assertEqual([b["bytes"] for b in info], [bytes_of(params, b) for b in want])

    def test_the_oracle_is_what_ddp_itself_rebuilds(self):
        """DDP itself (world 1, Gloo), after its rebuild: its buckets
        (_get_ddp_logging_data) for the MLP, whose gradients become ready in
        reverse registration order, are torch_plan's for every cap (so the
        oracle call is DDP's); for the conv net and the transformer block,
        where autograd readies some gradients out of that order (a bias
        before its weight), DDP's default buckets hold the same parameters
        as sfsync's, packed in another order."""
        import tempfile
        from torch.nn.parallel import DistributedDataParallel as DDP
        inputs = {"mlp": lambda: torch.randn(4, 256), "conv_net": lambda: torch.randn(2, 3, 16, 16),
                  "transformer_block": lambda: torch.randint(0, 1000, (5, 2))}
        with tempfile.TemporaryDirectory() as d:
            dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "store"),
                                    rank=0, world_size=1)
            saved_first = dist._DEFAULT_FIRST_BUCKET_BYTES
            try:
                for name, x in inputs.items():
                    for cap, first in CAPS if name == "mlp" else CAPS[:1]:
                        with self.subTest(model=name, cap_mb=cap, first_mb=first):
                            model = MODELS[name]()
                            params = list(model.parameters())
                            dist._DEFAULT_FIRST_BUCKET_BYTES = int(first * MIB)
                            ddp = DDP(model, **ddp_caps(cap, first))
                            for _ in range(3):  # rebuilt in the forward after the first backward
                                ddp(x()).float().sum().backward()
                            data = ddp._get_ddp_logging_data()
                            rebuilt = [[int(i) for i in b.split()] for b in
                                       data["rebuilt_per_bucket_param_indices"].split(",")]
                            got, _ = sfsync_plan(MODELS[name](), cap, first)
                            if name == "mlp":
                                self.assertEqual(rebuilt, torch_plan(params, cap, first))
                                want, _ = torch_plan_strict(params, cap, first)
                                self.assertEqual(got, want[torch.float32])
                            else:
                                self.assertNotEqual(rebuilt, torch_plan(params, cap, first))
                                self.assertEqual([sorted(b) for b in got], [sorted(b) for b in rebuilt])
                            del ddp
            finally:
                dist._DEFAULT_FIRST_BUCKET_BYTES = saved_first
                dist.destroy_process_group()

    def test_strict_cap_is_the_one_difference(self):
        # Two 0.6 MiB weights with a 1 MiB cap: torch's bucket takes both
        # (1.2 MiB, checked after adding), sfsync's stops at the cap.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(384, 400, bias=False),
                                    torch.nn.Linear(400, 384, bias=False),
                                    torch.nn.Linear(384, 8, bias=False))
        params = list(model.parameters())
        want = torch_plan(params, 1, 0.001)
        self.assertEqual(want, [[2], [1, 0]])
        self.assertGreater(bytes_of(params, want[1]), MIB)
        got, _ = sfsync_plan(model, 1, 0.001)
        self.assertEqual(got, [[2], [1], [0]])


if __name__ == "__main__":
    unittest.main()
