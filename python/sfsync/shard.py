"""The sharded-window calls of the C ABI (Since 0.3) on an sfsync.Context:
layouts, parameter registration, shard ranges, per-bucket waits, parameter
gathers, the gradient gather (Since 0.4) and the small float64 all-reduce, as
plain functions of a Context.

Convenience wrappers only: each calls the one binding,
``sfsync.lib().sf_xxx`` with the prototype of ``sfsync._abi``, which raises
an SfError subclass on failure (UnsupportedError naming the function when the
loaded library is older than it).
"""

import ctypes

import sfsync

__all__ = ["LAYOUTS", "layout_value", "set_layout", "register_parameter", "parameter_data",
           "shard_range", "gradient_bucket", "synchronize_start", "wait_bucket", "start_gather",
           "wait_gather", "gather_parameters", "gather_gradients", "allreduce_float64", "stats"]

#: shard_layout names (GradientSync's argument, env SF_SHARD) -> sf_shard_layout.
LAYOUTS = {"none": sfsync.SHARD_NONE, "flat": sfsync.SHARD_FLAT,
           "parameter": sfsync.SHARD_PARAMETER}


def layout_value(layout):
    """sf_shard_layout of a name ("none", "flat", "parameter") or an int."""
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    if isinstance(layout, int) and layout in LAYOUTS.values():
        return layout
    raise ValueError("shard_layout must be one of %s, not %r" % (", ".join(map(repr, LAYOUTS)),
                                                                 layout))


def set_layout(ctx, layout):
    sfsync.lib().sf_set_shard_layout(ctx.handle, layout_value(layout))


def register_parameter(ctx, gid, numel, dtype, device, data=None):
    """sf_register_parameter: data=None for a plugin-owned view of the flat
    parameter buffer (then read its address with parameter_data)."""
    sfsync.lib().sf_register_parameter(ctx.handle, gid, data, numel, dtype, device)


def parameter_data(ctx, gid):
    out = ctypes.c_void_p()
    sfsync.lib().sf_parameter_data(ctx.handle, gid, ctypes.byref(out))
    return out.value


def shard_range(ctx, gid):
    """(offset, count): the elements of gradient/parameter gid this rank owns."""
    off, cnt = ctypes.c_int64(), ctypes.c_int64()
    sfsync.lib().sf_shard_range(ctx.handle, gid, ctypes.byref(off), ctypes.byref(cnt))
    return off.value, cnt.value


def gradient_bucket(ctx, gid):
    out = ctypes.c_int64()
    sfsync.lib().sf_gradient_bucket(ctx.handle, gid, ctypes.byref(out))
    return out.value


def synchronize_start(ctx):
    sfsync.lib().sf_synchronize_start(ctx.handle)


def wait_bucket(ctx, bucket):
    sfsync.lib().sf_wait_bucket(ctx.handle, bucket)


def start_gather(ctx, bucket=-1):
    sfsync.lib().sf_start_gather(ctx.handle, bucket)


def wait_gather(ctx, bucket=-1):
    sfsync.lib().sf_wait_gather(ctx.handle, bucket)


def gather_parameters(ctx):
    sfsync.lib().sf_gather_parameters(ctx.handle)


def gather_gradients(ctx):
    """sf_gather_gradients (Since 0.4): after a sharded window's
    synchronization and before the parameter gathers, make every rank's
    gradients hold the whole reduced gradient (one all-gather per bucket).
    Free in an unsharded context or at world size 1."""
    sfsync.lib().sf_gather_gradients(ctx.handle)


def allreduce_float64(ctx, tensor):
    """Sum a contiguous CPU float64 torch tensor over the ranks, in place."""
    import torch
    if tensor.dtype != torch.float64 or tensor.is_cuda or not tensor.is_contiguous():
        raise TypeError("allreduce_float64: a contiguous CPU float64 tensor, not %s %s"
                        % (tensor.dtype, tensor.device))
    ptr = ctypes.cast(tensor.data_ptr(), ctypes.POINTER(ctypes.c_double))
    sfsync.lib().sf_allreduce_float64(ctx.handle, ptr, tensor.numel())


def stats(ctx):
    """ctx.stats(): every counter, the sharded ones (reduce_scatters,
    all_gathers, bytes_gathered) included."""
    return ctx.stats()
