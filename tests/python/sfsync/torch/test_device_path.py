"""sfsync.torch's device path on the CPU (issue 23): GradientSync, unsharded
and sharded (flat and parameter layouts) with AdamW, 2 ranks as threads,
through the STRICT CUDA/NCCL stand-ins (tests/standin): the flat gradient
and parameter buffers registered as SF_DEVICE_CUDA (allocated by the
plugin's NCCL backend with the stand-in's cudaMalloc: host memory posing as
device memory), the stream given to sf_set_cuda_stream, readiness and
completion events on the stand-in's streams, the stand-in NCCL's collectives
(its ranks meet in shared memory). The weights must equal, bit for bit, those
of the plain CPU path (CpuOps, host buffers, Gloo) on the same data.

The training loop runs on a stand-in stream other than the one current at
attach (``with ops.stream(train)``), so every ordering sfsync.torch owes
(the sync stream after autograd's, the optimizer's and the next backward's
stream after the plugin's work, the forward after the all-gather) is a real
cross-stream wait: the test counts each kind, exactly, and the stand-in
rejects any wait on an event never recorded (a misuse fails the test).

    SF_STANDIN_LIB_DIR=build/standin/lib PYTHONPATH=python \\
    SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 python3 tests/python/sfsync/torch/test_device_path.py -v
"""

import os
import sys
import threading
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # standin_env
from standin_env import STANDIN, needs_standin, require  # noqa: E402  (before sfsync)

import torch  # noqa: E402

import sfsync  # noqa: E402
import sfsync.torch as sft  # noqa: E402
from sfsync.torch import device  # noqa: E402
import device_standin  # noqa: E402  (tests/python/support: a test stand-in, not the package's)

require("test_device_path")

WORLD, WINDOWS, MICRO = 2, 3, 2


class CountingStandinOps(device_standin.StandinCudaOps):
    """The stand-in's ops, counting the cross-stream waits of each kind
    that sfsync.torch asked for (an event returned: two streams)."""

    def __init__(self, library):
        super().__init__(library)
        self.events = {"grad_ready": 0, "after_reduction": 0, "before_forward": 0}

    def _count(self, kind, event):
        if event is not None:
            self.events[kind] += 1
        return event

    def grad_ready(self, grad, sync_stream):
        return self._count("grad_ready", super().grad_ready(grad, sync_stream))

    def after_reduction(self, sync_stream, stream=None):
        return self._count("after_reduction", super().after_reduction(sync_stream, stream))

    def before_forward(self, gather_stream, stream=None):
        return self._count("before_forward", super().before_forward(gather_stream, stream))


def make_model(dtype=torch.float32):
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def batch(rank, window, micro, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + 10 * window + micro)
    return torch.randn(5, 8, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)


def train(rank, name, model, ops, backend, shard_optimizer, layout, out, **kw):
    """One rank: attach (on the ops' current stream), then WINDOWS windows of
    MICRO micro-batches and an AdamW step each, on a stream of its own when
    ``ops`` is the stand-in's."""
    weighted = kw.pop("weighted", False)  # reduce_op "weighted": summed losses, weigh()
    ctx = sfsync.Context(rank=rank, world_size=WORLD, local_rank=rank, rendezvous=name,
                         backend=backend, timeout_ms=60000,
                         reduce_op="weighted" if weighted else "average")
    sync = sft.GradientSync(model, context=ctx, accumulation_steps=MICRO, device_ops=ops,
                            shard_optimizer=shard_optimizer, shard_layout=layout,
                            bucket_cap_mb=0.0005, **kw)
    try:
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
        stream = ops.new_stream() if isinstance(ops, device_standin.StandinCudaOps) else None
        with (ops.stream(stream) if stream is not None else _nothing()):
            for w in range(WINDOWS):
                for m in range(MICRO):
                    x, y = batch(rank, w, m, model[0].weight.dtype)
                    if weighted:  # a weight per micro-batch: rows, as if of varying length
                        sync.weigh(5 + rank + 3 * m)
                        loss = torch.nn.functional.mse_loss(sync(x).float(), y.float(),
                                                            reduction="sum")
                    else:
                        loss = torch.nn.functional.mse_loss(sync(x).float(), y.float()) / MICRO
                    loss.backward()
                assert sync.is_step(), "window %d did not synchronize" % w
                opt.step()
                opt.zero_grad(set_to_none=False)
            opt.wait_parameters()
        if isinstance(ops, device_standin.StandinCudaOps):  # the views are the stand-in's memory
            for g in sync.accumulated_grads():  # (the .grad views, or the accumulators)
                ops.pointer(g)
            for p in model.parameters() if shard_optimizer else ():
                ops.pointer(p.data)
        out[rank] = {"weights": [p.detach().clone() for p in model.parameters()],
                     "state": opt.full_state_dict(), "stats": sync.stats()}
    finally:
        sync.close()
        ctx.close()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_ranks(make_ops, backend, shard_optimizer=False, layout="flat", **kw):
    name = "memory://device-path-%s" % uuid.uuid4().hex
    out, errors = [None] * WORLD, [None] * WORLD
    ops = [make_ops() for _ in range(WORLD)]
    # Made here, one after the other: torch's global generator is shared by
    # the threads (rank 1 gets other weights; the attach broadcasts rank 0's).
    models = []
    for r in range(WORLD):
        models.append(make_model(kw.get("dtype", torch.float32)))
        if r:
            with torch.no_grad():
                for p in models[r].parameters():
                    p.add_(1.0)
    kw.pop("dtype", None)

    def rank(r):
        try:
            train(r, name, models[r], ops[r], backend, shard_optimizer, layout, out, **kw)
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if any(t.is_alive() for t in threads):
        raise AssertionError("a rank hung (120 s)")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e
    return out, ops


@needs_standin
class DevicePathTests(unittest.TestCase):
    def standin(self):
        return CountingStandinOps(os.path.join(STANDIN, "libcudart.so.13"))

    def check(self, shard_optimizer, layout="flat", **kw):
        host, _ = run_ranks(lambda: None, "gloo", shard_optimizer, layout, **dict(kw))
        dev, ops = run_ranks(self.standin, "auto", shard_optimizer, layout, **dict(kw))
        for r in range(WORLD):
            for a, b in zip(host[r]["weights"], dev[r]["weights"]):
                self.assertTrue(torch.equal(a, b), "rank %d: the device path's weights differ "
                                "from the CPU path's (max %g)" % (r, (a - b).abs().max()))
            self.assertEqual(dev[r]["stats"]["windows_completed"], WINDOWS)
            for k, st in host[r]["state"]["state"].items():
                for key, v in st.items():
                    if isinstance(v, torch.Tensor):
                        self.assertTrue(torch.equal(v.cpu(), dev[r]["state"]["state"][k][key]
                                                    .cpu()), "rank %d state %s %s" % (r, k, key))
        for a, b in zip(dev[0]["weights"], dev[1]["weights"]):
            self.assertTrue(torch.equal(a, b), "the ranks' weights differ")
        # The device path really ran on the device kinds: SF_DEVICE_CUDA
        # buckets (the NCCL backend), stand-in compute points, no misuse.
        for r, o in enumerate(ops):
            # The flat buffers are the stand-in's "device" memory (the
            # plugin's NCCL backend allocated them): the views pass its check.
            self.assertGreater(o.counter("cudaMalloc"), 0)
            for w in dev[r]["weights"]:
                self.assertEqual(w.device.type, "cpu")
            n, last = o.take_misuse()
            self.assertEqual(n, 0, "stand-in misuse on the device path: %s" % last)
            self.assertGreater(o.compute_points, 0)
        params = len(host[0]["weights"])
        self.dev = dev
        return ops, params

    def reload_at_world1(self, layout):
        """The 2-rank run's full_state_dict() loaded by a sharded optimizer at
        world size 1 on the stand-in (another world size, the same device
        path): its full_state_dict() gives the same tensors back."""
        full = self.dev[0]["state"]
        model = make_model()
        with torch.no_grad():
            for p, w in zip(model.parameters(), self.dev[0]["weights"]):
                p.copy_(w)
        ops = self.standin()
        ctx = sfsync.Context(rank=0, world_size=1, backend="auto", timeout_ms=60000)
        sync = sft.GradientSync(model, context=ctx, device_ops=ops, shard_optimizer=True,
                                shard_layout=layout, bucket_cap_mb=0.0005)
        try:
            opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
            opt.load_state_dict(full)
            again = opt.full_state_dict()
        finally:
            sync.close()
            ctx.close()
        self.assertEqual(len(full["state"]), len(list(model.parameters())))  # AdamW's, each
        self.assertEqual(sorted(again["state"]), sorted(full["state"]))
        for k, st in full["state"].items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    self.assertTrue(torch.equal(v.cpu(), again["state"][k][key].cpu()),
                                    "state %s %s after the reload at world size 1" % (k, key))
        n, last = ops.take_misuse()
        self.assertEqual(n, 0, last)

    def test_unsharded_adamw_matches_the_cpu_path(self):
        ops, params = self.check(False)
        for o in ops:
            # Every gradient of every micro-batch, and the used mask at each
            # pass's end: the sync stream waits for autograd's stream.
            self.assertEqual(o.events["grad_ready"], WINDOWS * MICRO * (params + 1), o.events)
            # Per window: the optimizer's stream after sf_synchronize, the
            # next backward's after sf_zero_gradients.
            self.assertEqual(o.events["after_reduction"], WINDOWS * 2, o.events)
            self.assertEqual(o.events["before_forward"], 0, o.events)

    def test_bf16_accumulated_in_float32_matches_the_cpu_path(self):
        """accumulate_dtype=torch.float32 over a bf16 model: float32 device
        buckets, each micro-batch's bf16 .grad added in at its grad-ready."""
        ops, params = self.check(False, dtype=torch.bfloat16, accumulate_dtype=torch.float32)
        for o in ops:
            self.assertEqual(o.events["grad_ready"], WINDOWS * MICRO * (params + 1), o.events)
            self.assertEqual(o.events["after_reduction"], WINDOWS * 2, o.events)

    def test_weighted_unsharded_matches_the_cpu_path(self):
        """reduce_op "weighted" (issue 31) on CUDA buckets (the stand-in NCCL:
        the sum, then the division by the weight read from the bucket's own
        limbs on the plugin's stream): the CPU path's weights bit for bit."""
        ops, params = self.check(False, weighted=True)
        for o in ops:
            self.assertEqual(o.events["grad_ready"], WINDOWS * MICRO * (params + 1), o.events)

    def test_weighted_sharded_flat_matches_the_cpu_path(self):
        ops, params = self.check(True, "flat", weighted=True)
        self.sharded_counts(ops, params)

    def test_sharded_flat_adamw_matches_the_cpu_path(self):
        ops, params = self.check(True, "flat")
        self.sharded_counts(ops, params)
        self.reload_at_world1("flat")

    def test_sharded_parameter_adamw_matches_the_cpu_path(self):
        ops, params = self.check(True, "parameter")
        self.sharded_counts(ops, params)
        self.reload_at_world1("parameter")

    def sharded_counts(self, ops, params):
        for o in ops:
            # Sharded: the mask is summed apart (host), only gradients report.
            self.assertEqual(o.events["grad_ready"], WINDOWS * MICRO * params, o.events)
            # Per window: after sf_synchronize, after sf_gather_gradients,
            # after sf_zero_gradients.
            self.assertEqual(o.events["after_reduction"], WINDOWS * 3, o.events)
            # The next windows' forwards wait for the gathers (the first
            # window's forward has none in flight), and the last
            # wait_parameters().
            self.assertGreaterEqual(o.events["before_forward"], WINDOWS, o.events)


if __name__ == "__main__":
    unittest.main()
