"""Weighted windows for GradientSync (0.4, issue 31): per-token (or
per-sample) normalization over a whole window and every rank, with no extra
collective.

``GradientSync(model, reduce="weighted")`` (or ``reduce_op="weighted"``
through its context options: the same) makes every bucket the sum over
ranks and micro-batches divided by the window's global weight, which each
rank adds per micro-batch with ``sync.weigh(n)``. The loss is then a plain
sum::

    sync = GradientSync(model, accumulation_steps=4, reduce="weighted")
    for batch in loader:
        logits = sync(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100, reduction="sum")
        tokens = (batch["labels"] != -100).sum()
        sync.weigh(tokens)                              # before this backward
        sync.add_window_sums(loss=loss, tokens=tokens)  # optional: metrics, no collective
        loss.backward()
        if sync.is_step():    # .grad = sum of per-token gradients / the window's tokens
            opt.step(); opt.zero_grad()
            print(sync.window_sums()["loss"] / sync.window_sums()["tokens"])

The weight and the sums travel, in float64, in the same collective as the
gradients (the plugin's reserved tail of each bucket), so the clip, the
sharded optimizer and a 16-bit wire all see the weighted gradients.

Responsible for: the ``Weighing`` mixin of GradientSync (weigh,
add_window_sums, window_sums) and the reduce option's check. Not
responsible for: the arithmetic (the plugin's), the window (HostWindow).
"""

import sfsync
from sfsync.context import REDUCE_NAMES

__all__ = ["Weighing", "SUM_SLOTS", "reduce_option", "is_weighted", "zero_weight", "as_float"]

#: The window sum slots by name, in the plugin's order (sf_add_window_sums).
SUM_SLOTS = ("loss", "tokens", "found_inf", "metric")
_NAMES_BY_VALUE = {v: k for k, v in REDUCE_NAMES.items()}


def reduce_option(reduce, options, context):
    """GradientSync's ``reduce=`` folded into the context ``options``
    (``reduce_op``), or checked against the caller's ``context``: ValueError
    naming both when they disagree."""
    if reduce is None:
        return options
    wanted = _value(reduce, "reduce")
    if context is not None:
        have = context.options()["reduce_op"]
        if have != wanted:
            raise ValueError("GradientSync(reduce=%r): the context given has reduce_op %s; "
                             "make the context with reduce_op=%r, or leave reduce out"
                             % (reduce, _NAMES_BY_VALUE.get(have, have), reduce))
        return options
    if "reduce_op" in options and _value(options["reduce_op"], "reduce_op") != wanted:
        raise ValueError("GradientSync: reduce=%r and reduce_op=%r disagree (one is enough)"
                         % (reduce, options["reduce_op"]))
    options = dict(options)
    options["reduce_op"] = wanted
    return options


def zero_weight(context):
    """The window the plugin just refused was one of global weight 0 (the
    plugin then reports that weight for it), not another failure."""
    if not is_weighted(context):
        return False
    try:
        return context.window_totals()[0] == 0
    except sfsync.SfError:
        return False


def _value(reduce, who):
    if isinstance(reduce, str):
        if reduce not in REDUCE_NAMES:
            raise ValueError("GradientSync: %s=%r is not one of %s"
                             % (who, reduce, ", ".join(sorted(REDUCE_NAMES))))
        return REDUCE_NAMES[reduce]
    return int(reduce)


def as_float(value, who):
    """A Python float from an int, a float, a numpy scalar or a tensor of one
    element (detached; a CUDA tensor is copied to the host: a device sync)."""
    if hasattr(value, "detach"):
        if value.numel() != 1:
            raise ValueError("%s: a tensor of %d elements, not one number (shape %s)"
                             % (who, value.numel(), tuple(value.shape)))
        return float(value.detach().reshape(()).item())
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError(value)
        return float(value)
    except (TypeError, ValueError):
        raise TypeError("%s: expected a number or a one-element tensor, not %s"
                        % (who, type(value).__name__)) from None


class Weighing:
    """GradientSync's weighted-window methods (see the module docstring).
    Needs ``self.context`` and, for window_sums with overlap_step, the
    face's WindowDriver (window_driver.py)."""

    context = None
    _driver = None

    @property
    def reduce(self):
        """The context's reduce_op by name ("average", "sum", "weighted", ...)."""
        value = self.context.options()["reduce_op"]
        return _NAMES_BY_VALUE.get(value, value)

    def weigh(self, n):
        """Add ``n`` (this micro-batch's weight, e.g. its token count) to this
        rank's weight for the window, before the micro-batch's backward.
        ``n``: an int, a float, or a tensor of one element (a CUDA tensor is
        read back to the host: that synchronizes with the device; count on
        the CPU where the labels are there). Every bucket of the window is
        divided by the sum of every rank's weights.

        Raises sfsync.InvalidStateError (the library's message) when the
        GradientSync is not ``reduce="weighted"``, or when the window's last
        backward pass has already started reducing a bucket (it names the
        bucket and the window; nothing is added); InvalidArgumentError for a
        negative or non-finite weight."""
        self.context.add_window_weight(as_float(n, "weigh"))

    def add_window_sums(self, loss=None, tokens=None, found_inf=None, metric=None):
        """Add to this rank's window sums, by slot (each an int, float or
        one-element tensor, detached; None adds nothing there). They are
        summed over every rank and micro-batch with the gradients (no
        collective) and read after the window with ``window_sums()``. Same
        timing rule and errors as ``weigh``; values must be finite."""
        values = [loss, tokens, found_inf, metric]
        last = max((i for i, v in enumerate(values) if v is not None), default=-1)
        if last < 0:
            return
        self.context.add_window_sums([0.0 if v is None else as_float(v, "add_window_sums(%s)"
                                                                     % SUM_SLOTS[i])
                                      for i, v in enumerate(values[:last + 1])])

    def window_sums(self):
        """The last synchronized window's global totals, as a dict: "weight"
        (the sum of every rank's ``weigh``) and the sums "loss", "tokens",
        "found_inf", "metric" of every rank's ``add_window_sums``. Valid from
        ``is_step()`` (with an ``overlap_step=True`` optimizer this first
        waits for the window's reductions) until the next window synchronizes.
        InvalidStateError before the first weighted window completed."""
        if self._driver is not None:
            self._driver.wait_gradients()
        weight, sums = self.context.window_totals()
        out = {"weight": weight}
        out.update(zip(SUM_SLOTS, sums))
        return out


def is_weighted(context):
    """True when the context reduces with reduce_op "weighted"."""
    return context.options()["reduce_op"] == sfsync.REDUCE_WEIGHTED
