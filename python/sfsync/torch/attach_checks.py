"""What GradientSync checks of its arguments and its module, and the
closures of its autograd hooks: the trainable parameters and their
signature (the layout check at each synchronization), ``accumulate_dtype``,
the shard setting against the context's (which then holds it: the
sharded default bucket cap is the plugin's since 0.5), and hooks that hold
GradientSync weakly.

Not responsible for: attaching (gradient_sync.py), the window's
collectives (window_driver.py).
"""

import os

import torch

from sfsync import shard

__all__ = ["trainable", "signature", "check_layout", "check_shard_setting",
           "ACCUMULATE_DTYPES", "accumulate_dtype_of", "call", "grad_hook",
           "post_accumulate_hook", "forward_hook", "GradReport", "install_grad_hooks"]


def trainable(module):
    """The parameters sfsync synchronizes: those that require grad and
    have elements (a zero-size one, which DDP accepts, has nothing to
    reduce: autograd gives it its own empty .grad)."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for p in module.parameters() if p.requires_grad and p.numel() > 0]
    return params, [names.get(id(p), "param%d" % i) for i, p in enumerate(params)]


def check_shard_setting(context, shard_optimizer, shard_layout):
    """ValueError naming both when the context is sharded (the C side holds
    that: SF_SHARD in the environment, or the options of a context handed
    in) and GradientSync's ``shard_optimizer`` / ``shard_layout`` say
    otherwise. Unchecked, a sharded C context under an unsharded
    GradientSync failed only when the buckets were built."""
    held = context.options()["shard_layout"]
    if held == shard.LAYOUTS["none"]:
        return  # the argument decides (shard.set_layout)
    name = {v: k for k, v in shard.LAYOUTS.items()}.get(held, held)
    env = os.environ.get("SF_SHARD", "")
    source = ("SF_SHARD=%s in the environment" % env if env
              else "the context's shard_layout %r" % name)
    if not shard_optimizer:
        raise ValueError("GradientSync(shard_optimizer=False) on a sharded context (%s): pass "
                         "shard_optimizer=True (shard_layout=%r) to shard, or unset SF_SHARD "
                         "(a context with shard_layout 'none') not to" % (source, name))
    if shard.layout_value(shard_layout) != held:
        raise ValueError("GradientSync(shard_layout=%r) on a context sharded %r (%s): pass "
                         "shard_layout=%r, or make both the same" % (shard_layout, name, source,
                                                                     name))


def signature(params):
    """What check_layout compares: each parameter's id, shape, dtype, device."""
    return [(id(p), tuple(p.shape), p.dtype, p.device) for p in params]


def check_layout(module, attached, attached_names):
    """RuntimeError naming the parameter when the module's trainable
    parameters are no longer those GradientSync attached (``attached``:
    their signature() then, with their names)."""
    params, names = trainable(module)
    sig = signature(params)
    if sig == attached:
        return
    old = {s[0]: (s, n) for s, n in zip(attached, attached_names)}
    new = {s[0]: (s, n) for s, n in zip(sig, names)}
    for s, n in zip(sig, names):
        if s[0] not in old:
            raise RuntimeError("sfsync: parameter %r (shape %s) was added or replaced after "
                               "GradientSync attached the module; its gradient would not be "
                               "synchronized: attach again (a new GradientSync)"
                               % (n, list(s[1])))
    for s, n in zip(attached, attached_names):
        if s[0] not in new:
            raise RuntimeError("sfsync: parameter %r was removed, replaced or frozen after "
                               "GradientSync attached the module: attach again" % n)
        if new[s[0]][0] != s:
            raise RuntimeError("sfsync: parameter %r changed from shape %s %s to %s %s after "
                               "GradientSync attached the module: attach again"
                               % (n, list(s[1]), s[2], list(new[s[0]][0][1]),
                                  new[s[0]][0][2]))
    raise RuntimeError("sfsync: the module's parameters were reordered after GradientSync "
                       "attached it: attach again")


ACCUMULATE_DTYPES = (torch.float32, torch.float64)


def accumulate_dtype_of(value, flat_buffer, hooks, shard_optimizer):
    """GradientSync's accumulate_dtype, checked (ValueError naming it)."""
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or value not in ACCUMULATE_DTYPES:
        raise ValueError("GradientSync: accumulate_dtype must be None, torch.float32 or "
                         "torch.float64, not %r" % (value,))
    if not flat_buffer:
        raise ValueError("GradientSync(accumulate_dtype=%s) accumulates in the plugin's flat "
                         "buffer: flat_buffer=False does not fit" % value)
    if not hooks:
        raise ValueError("GradientSync(accumulate_dtype=%s) adds each micro-batch's gradient "
                         "at its grad-ready hook: hooks=False does not fit" % value)
    if shard_optimizer:
        raise ValueError("GradientSync(accumulate_dtype=%s, shard_optimizer=True): not "
                         "supported: a sharded parameter's buffer has its gradient's dtype "
                         "(sf_register_parameter); the sharded optimizer already steps "
                         "float32 master shards of 16-bit parameters" % value)
    return value


def call(method, *args):
    """Call a WeakMethod's method while its object lives."""
    fn = method()
    if fn is not None:
        fn(*args)


def grad_hook(method, i):
    def hook(grad_inputs, grad_outputs):
        call(method, i)
    return hook


# A tensor no .grad is: the view of a parameter that is not plain in a
# GradReport (it takes the long way).
_NOT_PLAIN = torch.empty(0)


class GradReport:
    """What the post-accumulate-grad hooks read to report a plain host
    gradient themselves (issue 46: the transformer of bench/torch2_bench.py
    runs 148 hooks per backward, four backwards per window): while a pass
    runs (``ready`` set by GradientSync._start_pass, cleared at its end), a
    parameter whose ``.grad`` is its view in the flat buffer
    (GradientStore.plain) is marked reported and handed to sf_grad_ready in
    the hook, without a frame of GradientSync's. In the window's first pass
    (``adopt``) a plain parameter's fresh ``.grad`` (autograd's, after a
    ``zero_grad`` set it to None) is adopted there too: copied into its
    view, which becomes its ``.grad`` again (GradientStore.adopt_grad's
    common case: 148 adoptions a window on the transformer, about 1.5 ms
    of the first backward's CPU less than through GradientSync's frames).
    The rest (a pass's first hook, an accumulated, masked or device
    gradient, a ``.grad`` replaced after the first pass) goes through
    GradientSync._hook_grad. Holds no reference to the GradientSync: the
    hooks must not keep it alive."""

    __slots__ = ("ready", "adopt", "views", "ids", "reported")

    def __init__(self, views, ids):
        self.ready = None      # the context's grad_ready while a pass runs
        self.adopt = False     # the pass is the window's first: fresh .grad are adopted
        self.views = views     # per parameter: its view if plain, else _NOT_PLAIN
        self.ids = ids         # per parameter: its gradient id
        self.reported = None   # GradientSync._reported of the pass


def post_accumulate_hook(method, i, report):
    def hook(param):
        ready = report.ready
        if ready is not None:
            g, view = param.grad, report.views[i]
            if g is view:
                report.reported[i] = True
                ready(report.ids[i])
                return
            if report.adopt and view is not _NOT_PLAIN and g is not None and \
                    g.data_ptr() != view.data_ptr():
                view.copy_(g)  # (GradientStore.adopt_grad)
                param.grad = view
                report.reported[i] = True
                ready(report.ids[i])
                return
        call(method, i)
    return hook


def install_grad_hooks(params, store, grad):
    """Each parameter's hook at its gradient's accumulation, calling the
    WeakMethod ``grad`` with its index; returns (the hooks' GradReport or
    None, [(the node holding the hook or None, its handle)])."""
    handles = []
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):  # torch < 2.1
        with torch.enable_grad():
            for i, p in enumerate(params):
                # torch 1.13: a post hook on p's AccumulateGrad node (the
                # same moment). Kept here: the parameter holds it weakly.
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                handles.append((acc, acc.register_hook(grad_hook(grad, i))))
        return None, handles
    report = GradReport([v if plain else _NOT_PLAIN for v, plain in zip(store.views, store.plain)],
                        list(store.ids))
    for i, p in enumerate(params):  # runs after the new gradient was added into p.grad
        handles.append((None, p.register_post_accumulate_grad_hook(
            post_accumulate_hook(grad, i, report))))
    return report, handles


def forward_hook(method):
    def hook(module, inputs):
        call(method)
    return hook
