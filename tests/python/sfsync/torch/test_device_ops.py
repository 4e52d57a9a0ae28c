"""Tests of python/sfsync/device.py (issue 23): CpuOps, CudaOps' refusals
without a GPU, and StandinCudaOps on the strict CUDA stand-in, with the
whole device path through the plugin: SF_DEVICE_CUDA gradients (the plugin's
flat buffer, allocated by its NCCL backend on the stand-in), the stream given
to sf_set_cuda_stream, readiness events on an "autograd" stream, the
optimizer's stream waiting for the reduction, 2 ranks as threads on the
stand-in NCCL.

    SF_STANDIN_LIB_DIR=build/standin/lib PYTHONPATH=python \\
    SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 python3 tests/python/sfsync/torch/test_device_ops.py -v

The stand-in is loaded by path (SF_CUDART_LIBRARY / SF_NCCL_LIBRARY for the
plugin), which works beside pip torch's real libcudart.so.13 too. Without
SF_STANDIN_LIB_DIR the stand-in cases are skipped, a failure with CI=true.
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
from sfsync.torch import device  # noqa: E402
import device_standin  # noqa: E402  (tests/python/support: a test stand-in, not the package's)

require("test_device_ops")


class CpuOpsTests(unittest.TestCase):
    def test_host_pointers_and_no_streams(self):
        ops = device.ops_for("cpu")
        self.assertIsInstance(ops, device.CpuOps)
        self.assertEqual(ops.sf_device, sfsync.DEVICE_HOST)
        t = torch.arange(6, dtype=torch.float32)
        self.assertEqual(ops.pointer(t), t.data_ptr())
        self.assertIsNone(ops.current_stream())
        self.assertIsNone(ops.stream_handle(ops.current_stream()))
        self.assertIsNone(ops.record_event())
        self.assertIsNone(ops.grad_ready(t, None))
        self.assertIsNone(ops.after_reduction(None))
        self.assertIsNone(ops.before_forward(None))
        with self.assertRaisesRegex(ValueError, "contiguous"):
            ops.pointer(torch.zeros(4, 4).t())

    def test_wrap_is_a_view_of_the_memory(self):
        ops = device.CpuOps()
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            src = torch.arange(12, dtype=dtype)
            w = ops.wrap(src.data_ptr(), 12, dtype, (3, 4), owner=src)
            self.assertEqual((w.dtype, tuple(w.shape)), (dtype, (3, 4)))
            self.assertTrue(torch.equal(w.reshape(-1), src))
            w[0, 0] = 7
            self.assertEqual(float(src[0]), 7.0)  # the same memory, no copy
        with self.assertRaisesRegex(ValueError, r"shape \(5,\) has 5 elements, not numel=6"):
            ops.wrap(src.data_ptr(), 6, torch.float32, (5,))
        with self.assertRaisesRegex(TypeError, "not torch.int32"):
            ops.wrap(src.data_ptr(), 6, torch.int32)

    def test_other_devices_are_refused(self):
        with self.assertRaisesRegex(TypeError, "meta"):
            device.ops_for("meta")


class CudaOpsTests(unittest.TestCase):
    @unittest.skipIf(torch.cuda.is_available(), "a GPU is visible (tests/gpu covers CudaOps)")
    def test_refuses_without_a_gpu(self):
        with self.assertRaisesRegex(RuntimeError, r"torch.cuda.is_available\(\) is False"):
            device.ops_for("cuda")
        with self.assertRaisesRegex(ValueError, "must be a CUDA device, not cpu"):
            device.CudaOps("cpu")


@needs_standin
class StandinOpsTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ops = device_standin.StandinCudaOps(os.path.join(STANDIN, "libcudart.so.13"))

    def tearDown(self):
        n, last = self.ops.take_misuse()
        self.assertEqual(n, 0, "untaken stand-in misuse: %s" % last)

    def test_refuses_a_library_that_is_not_the_standin(self):
        import ctypes.util
        libm = ctypes.util.find_library("m")
        with self.assertRaisesRegex(RuntimeError, "not the CUDA stand-in"):
            device_standin.StandinCudaOps(libm)

    def test_a_wait_on_an_unrecorded_event_is_rejected(self):
        ops = self.ops
        event = ops.new_event()
        with self.assertRaisesRegex(RuntimeError, "cudaStreamWaitEvent failed: "
                                    "cudaErrorInvalidResourceHandle.*never recorded"):
            ops.wait_event(event)
        ops.record_event(event=event)
        ops.wait_event(event)  # recorded: fine
        ops.release(event)
        with self.assertRaisesRegex(RuntimeError, "destroyed by cudaEventDestroy"):
            ops.wait_event(event)
        s = ops.new_stream()
        ops.destroy_stream(s)
        with self.assertRaisesRegex(RuntimeError, "cudaEventRecord failed.*destroyed by "
                                    "cudaStreamDestroy"):
            ops.record_event(s)

    def test_pointer_refuses_plain_host_memory(self):
        t = self.ops.empty(8, torch.float32)
        self.assertEqual(self.ops.pointer(t), t.data_ptr())
        self.assertEqual(self.ops.sf_device, sfsync.DEVICE_CUDA)
        with self.assertRaisesRegex(ValueError, "not the stand-in's device memory"):
            self.ops.pointer(torch.zeros(8))

    def test_grad_ready_orders_the_sync_stream_after_autograds(self):
        """The readiness event: the sync stream's next work runs only after
        what the autograd stream queued for the gradient (a gate holds the
        autograd stream: nothing behind the event can have run)."""
        ops = self.ops
        sync, autograd = ops.new_stream(), ops.new_stream()
        grad, out = ops.empty(4, torch.float32), torch.zeros(4)
        ops.copy_async(grad, torch.zeros(4), sync)
        ops.synchronize(sync)
        gate = threading.Event()
        waits = ops.counter("cudaStreamWaitEvent")
        with ops.stream(autograd):
            ops.host_func(lambda: gate.wait(30))
            ops.copy_async(grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # the "backward kernel"
            event = ops.grad_ready(grad, sync)
        self.assertIsNotNone(event)
        self.assertEqual(ops.counter("cudaStreamWaitEvent"), waits + 1)
        ops.copy_async(out, grad, sync)  # the "collective" reading the gradient
        self.assertFalse(ops.query(sync))
        self.assertEqual(out.tolist(), [0.0] * 4)
        gate.set()
        ops.synchronize(sync)
        self.assertEqual(out.tolist(), [1.0, 2.0, 3.0, 4.0])
        ops.release(event)
        # On one stream nothing is recorded: a stream orders itself.
        with ops.stream(sync):
            self.assertIsNone(ops.grad_ready(grad, sync))
        self.assertEqual(ops.counter("cudaStreamWaitEvent"), waits + 1)

    def test_after_reduction_and_before_forward_wait_on_the_device(self):
        """The optimizer's stream after the reduction, the forward after the
        all-gather: device-side waits (counted), no host synchronization, and
        the order holds (a gate holds the sync stream)."""
        ops = self.ops
        sync, optimizer = ops.new_stream(), ops.new_stream()
        gate, seen = threading.Event(), []

        def reduction():
            gate.wait(30)
            seen.append("reduction")
        ops.host_func(reduction, sync)
        synchronizations = ops.counter("cudaStreamSynchronize")
        waits = ops.counter("cudaStreamWaitEvent")
        with ops.stream(optimizer):
            e1 = ops.after_reduction(sync)
            ops.host_func(lambda: seen.append("step"))
            e2 = ops.before_forward(sync)
            ops.host_func(lambda: seen.append("forward"))
        self.assertEqual(ops.counter("cudaStreamSynchronize"), synchronizations)  # no host wait
        self.assertEqual(ops.counter("cudaStreamWaitEvent"), waits + 2)
        self.assertEqual(seen, [])  # the gate holds the sync stream, the waits the rest
        gate.set()
        ops.synchronize(optimizer)
        self.assertEqual(seen, ["reduction", "step", "forward"])
        ops.release(e1)
        ops.release(e2)


@needs_standin
class StandinDevicePathTests(unittest.TestCase):
    """SF_DEVICE_CUDA gradients through the plugin's NCCL backend on the
    stand-ins, 2 ranks as threads: every line of the device path but the
    device calls, with the stand-in's strict streams and events."""

    WINDOWS, N = 3, 1000

    def test_two_ranks_flat_device_buffer(self):
        ops = device_standin.StandinCudaOps(os.path.join(STANDIN, "libcudart.so.13"))
        world, name = 2, "memory://device-ops-%s" % uuid.uuid4().hex
        results, errors = [None] * world, [None] * world
        nccl_before = None
        stats = [None] * world

        def rank(r):
            try:
                ctx = sfsync.Context(rank=r, world_size=world, local_rank=r, rendezvous=name,
                                     backend="nccl", timeout_ms=60000)
                try:
                    sync_stream, autograd = ops.new_stream(), ops.new_stream()
                    ctx.set_cuda_stream(ops.stream_handle(sync_stream))
                    gid = ctx.add_gradient(self.N, sfsync.DTYPE_FLOAT32, ops.sf_device, "w")
                    ctx.build_buckets()
                    grad = ops.wrap(ctx.gradient_data(gid), self.N, torch.float32, owner=ctx)
                    self.assertEqual(ops.pointer(grad), ctx.gradient_data(gid))
                    ctx.connect()
                    out = []
                    for w in range(self.WINDOWS):
                        ctx.zero_gradients()  # on the sync stream
                        with ops.stream(autograd):
                            # the "backward": on autograd's stream, after the zeroing
                            zeroed = ops.record_event(sync_stream)
                            ops.wait_event(zeroed)
                            value = torch.full((self.N,), float((r + 1) * (w + 1)))
                            ops.copy_async(grad, value)
                            ready = ops.grad_ready(grad, sync_stream)
                        ctx.grad_ready(gid)
                        ctx.synchronize()
                        host = torch.zeros(self.N)
                        with ops.stream(ops.new_stream()) as step:
                            done = ops.after_reduction(sync_stream)
                            ops.copy_async(host, grad)  # the "optimizer" reads it
                            ops.synchronize(step)
                        out.append(host.tolist())
                        for e in (zeroed, ready, done):
                            ops.release(e)
                    results[r] = out
                    stats[r] = ctx.stats()
                finally:
                    ctx.close()
            except BaseException as e:  # noqa: B902 - reported by the main thread
                errors[r] = e

        nccl_before = ops.counter("cudaStreamWaitEvent")
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertFalse(any(t.is_alive() for t in threads), "a rank hung")
        for r, e in enumerate(errors):
            if e is not None:
                raise AssertionError("rank %d: %r" % (r, e))
        for w in range(self.WINDOWS):
            want = (1 + 2) * (w + 1) / 2.0  # the average over the 2 ranks
            for r in range(world):
                self.assertEqual(set(results[r][w]), {want}, "rank %d window %d" % (r, w))
        for r in range(world):
            self.assertEqual(stats[r]["windows_completed"], self.WINDOWS, stats[r])
            self.assertGreaterEqual(stats[r]["bytes_reduced"], self.WINDOWS * self.N * 4, stats[r])
        # Per rank and window: our 3 cross-stream waits + the plugin's 2
        # (its stream after the host's, the host's after the collective).
        self.assertGreaterEqual(ops.counter("cudaStreamWaitEvent") - nccl_before,
                                world * self.WINDOWS * 5)
        n, last = ops.take_misuse()
        self.assertEqual(n, 0, "stand-in misuse on the device path: %s" % last)


@needs_standin
class StandinContractTests(unittest.TestCase):
    """What the torch integration must keep (found with the strict stand-in)."""

    def test_the_stream_given_to_the_plugin_must_outlive_the_context(self):
        """sf_destroy frees the plugin's device buffers after recording an
        event on the host's stream (sf_set_cuda_stream): a stream destroyed
        before close() is a use after free on CUDA, a misuse here. So
        sfsync.torch keeps the stream it passed alive until close() (torch's
        current stream of a device is; a user's torch.cuda.Stream may not be)."""
        ops = device_standin.StandinCudaOps(os.path.join(STANDIN, "libcudart.so.13"))
        ops.take_misuse()
        s = ops.new_stream()
        ctx = sfsync.Context(rank=0, world_size=1, rendezvous="", backend="nccl")
        ctx.set_cuda_stream(ops.stream_handle(s))
        ctx.add_gradient(64, sfsync.DTYPE_FLOAT32, ops.sf_device, "w")
        ctx.build_buckets()
        ops.destroy_stream(s)
        ctx.close()
        n, last = ops.take_misuse()
        self.assertGreaterEqual(n, 1)
        self.assertIn("destroyed by cudaStreamDestroy", last)


if __name__ == "__main__":
    unittest.main()
