"""The sharded-window calls of the C ABI (Since 0.3) on an sfsync.Context:
layouts, parameter registration, shard ranges, per-bucket waits, parameter
gathers, the gradient gather (Since 0.4) and the small float64 all-reduce, as
plain functions of a Context.

They bind the functions themselves (``sfsync.lib()`` plus argtypes) so that
they work whether or not ``sfsync._PROTOTYPES`` lists them; the raw names are
those of include/sfsync.h.
"""

import ctypes

import sfsync

__all__ = ["LAYOUTS", "layout_value", "set_layout", "register_parameter", "parameter_data",
           "shard_range", "gradient_bucket", "synchronize_start", "wait_bucket", "start_gather",
           "wait_gather", "gather_parameters", "gather_gradients", "allreduce_float64", "stats"]

#: shard_layout names (GradientSync's argument, env SF_SHARD) -> sf_shard_layout.
LAYOUTS = {"none": 0, "flat": 1, "parameter": 2}

_c = ctypes
_P = _c.c_void_p  # the context pointer travels as its address
_ARGTYPES = {
    "sf_set_shard_layout": [_P, _c.c_int32],
    "sf_register_parameter": [_P, _c.c_int64, _c.c_void_p, _c.c_int64, _c.c_int32, _c.c_int32],
    "sf_parameter_data": [_P, _c.c_int64, _c.POINTER(_c.c_void_p)],
    "sf_shard_range": [_P, _c.c_int64, _c.POINTER(_c.c_int64), _c.POINTER(_c.c_int64)],
    "sf_gradient_bucket": [_P, _c.c_int64, _c.POINTER(_c.c_int64)],
    "sf_synchronize_start": [_P],
    "sf_wait_bucket": [_P, _c.c_int64],
    "sf_start_gather": [_P, _c.c_int64],
    "sf_wait_gather": [_P, _c.c_int64],
    "sf_gather_parameters": [_P],
    "sf_gather_gradients": [_P],  # since 0.4
    "sf_allreduce_float64": [_P, _c.POINTER(_c.c_double), _c.c_int64],
}
#: The sfsync version that added each function not in 0.3.
_SINCE = {"sf_gather_gradients": "0.4"}
_bound = {}


def _fn(name):
    fn = _bound.get(name)
    if fn is None:
        dll = sfsync.lib()
        try:
            raw = getattr(dll, name)
        except AttributeError:
            raise sfsync.UnsupportedError(
                sfsync.ERR_UNSUPPORTED, "%s: the loaded libsfsync (%s) does not export it (it is "
                "older than sfsync %s)" % (name, sfsync.library_path(), _SINCE.get(name, "0.3")),
                None, name) from None
        # A private handle on the symbol: our argtypes never touch the binding's.
        fn = _c.CFUNCTYPE(_c.c_int32, *_ARGTYPES[name])(_c.cast(raw, _c.c_void_p).value)

        def call(*args, _fn=fn, _name=name):
            status = _fn(*args)
            if status != sfsync.OK:
                raise sfsync._error_for(dll, status, _name)
            return status
        _bound[name] = fn = call
    return fn


def _h(ctx):
    return _c.cast(ctx.handle, _c.c_void_p)


def layout_value(layout):
    """sf_shard_layout of a name ("none", "flat", "parameter") or an int."""
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    if isinstance(layout, int) and layout in LAYOUTS.values():
        return layout
    raise ValueError("shard_layout must be one of %s, not %r" % (", ".join(map(repr, LAYOUTS)),
                                                                 layout))


def set_layout(ctx, layout):
    _fn("sf_set_shard_layout")(_h(ctx), layout_value(layout))


def register_parameter(ctx, gid, numel, dtype, device, data=None):
    """sf_register_parameter: data=None for a plugin-owned view of the flat
    parameter buffer (then read its address with parameter_data)."""
    _fn("sf_register_parameter")(_h(ctx), gid, data, numel, dtype, device)


def parameter_data(ctx, gid):
    out = _c.c_void_p()
    _fn("sf_parameter_data")(_h(ctx), gid, _c.byref(out))
    return out.value


def shard_range(ctx, gid):
    """(offset, count): the elements of gradient/parameter gid this rank owns."""
    off, cnt = _c.c_int64(), _c.c_int64()
    _fn("sf_shard_range")(_h(ctx), gid, _c.byref(off), _c.byref(cnt))
    return off.value, cnt.value


def gradient_bucket(ctx, gid):
    out = _c.c_int64()
    _fn("sf_gradient_bucket")(_h(ctx), gid, _c.byref(out))
    return out.value


def synchronize_start(ctx):
    _fn("sf_synchronize_start")(_h(ctx))


def wait_bucket(ctx, bucket):
    _fn("sf_wait_bucket")(_h(ctx), bucket)


def start_gather(ctx, bucket=-1):
    _fn("sf_start_gather")(_h(ctx), bucket)


def wait_gather(ctx, bucket=-1):
    _fn("sf_wait_gather")(_h(ctx), bucket)


def gather_parameters(ctx):
    _fn("sf_gather_parameters")(_h(ctx))


def gather_gradients(ctx):
    """sf_gather_gradients (Since 0.4): after a sharded window's
    synchronization and before the parameter gathers, make every rank's
    gradients hold the whole reduced gradient (one all-gather per bucket).
    Free in an unsharded context or at world size 1."""
    _fn("sf_gather_gradients")(_h(ctx))


def allreduce_float64(ctx, tensor):
    """Sum a contiguous CPU float64 torch tensor over the ranks, in place."""
    import torch
    if tensor.dtype != torch.float64 or tensor.is_cuda or not tensor.is_contiguous():
        raise TypeError("allreduce_float64: a contiguous CPU float64 tensor, not %s %s"
                        % (tensor.dtype, tensor.device))
    ptr = _c.cast(tensor.data_ptr(), _c.POINTER(_c.c_double))
    _fn("sf_allreduce_float64")(_h(ctx), ptr, tensor.numel())


class _Stats03(ctypes.Structure):
    _fields_ = list(sfsync.Stats._fields_[:14]) + [
        ("reduce_scatters", ctypes.c_int64),
        ("all_gathers", ctypes.c_int64),
        ("bytes_gathered", ctypes.c_int64),
    ]


def stats(ctx):
    """ctx.stats() with the 0.3 counters (reduce_scatters, all_gathers,
    bytes_gathered), whether or not the binding's Stats has them yet."""
    out = _Stats03()
    out.struct_size = ctypes.sizeof(out)
    sfsync.lib().sf_get_stats(ctx.handle, ctypes.cast(ctypes.byref(out),
                                                      ctypes.POINTER(sfsync.Stats)))
    return {name: int(getattr(out, name)) for name, _ in out._fields_ if name != "struct_size"}
