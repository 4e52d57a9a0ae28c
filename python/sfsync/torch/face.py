"""What every host face shares (GradientSync, the DDP attachment, and
through them the framework integrations): one ``HostWindow`` per face
(sfsync/host_window.py: which pass stays local), the host's ``no_sync()``,
the window count read through the face (asked of the plugin, its one
holder: see ``windows``), the verify_every cadence, and the face's own
state dict.

Responsible for: ``WindowFace`` (the base class of GradientSync and
DDPSync), ``check_counts`` and ``set_window`` (a pass's decision applied to
the context). Not responsible for: counting passes (HostWindow does, once,
for every face), the hooks that see the passes (gradient_sync.py, ddp.py).
"""

import contextlib
import inspect

import torch

import sfsync
from sfsync.torch.rendezvous import log

__all__ = ["WindowFace", "check_counts", "set_window", "SET_TO_NONE_DEFAULT"]

#: torch's own default for zero_grad(set_to_none=...): False in 1.13, True since 2.0.
SET_TO_NONE_DEFAULT = inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
    "set_to_none"].default

_STATE_FORMAT = 1


def check_counts(who, accumulation_steps, verify_every):
    """ValueError naming the argument unless each is None or an int >= 1."""
    for name, value in (("accumulation_steps", accumulation_steps),
                        ("verify_every", verify_every)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError("%s: %s must be an integer >= 1 or None, not %r"
                             % (who, name, value))


def set_window(context, local):
    """The context's window state for a pass that stays local (inside a
    window) or synchronizes (outside)."""
    if context.in_accumulation() != local:
        if local:
            context.begin_accumulation()
        else:
            context.end_accumulation()


class WindowFace:
    """What GradientSync and DDPSync share: the HostWindow (which pass stays
    local), the host's no_sync() flag, and the window numbers read through
    the face (windows, accumulation_steps, is_step)."""

    _window = None           # the face's HostWindow (set by the subclass)
    _host_inside = False     # inside the host's no_sync()
    _verifier = None         # verify.Verifier with verify_every, else None
    _verify_every = None
    _last_verified = 0       # the window of the last replica check
    _closed_windows = 0      # ``windows`` once closed (the plugin's last count)
    context = None

    def _at_window_boundary(self):
        """No pass of a window is open (subclasses refine it)."""
        return self._window.at_boundary

    @property
    def accumulation_steps(self):
        return self._window.accumulation_steps

    @property
    def windows(self):
        """Windows synchronized (= optimizer steps): the plugin's count, its
        one holder (``_plugin_windows``: sf_stats.windows_completed; counted
        at sf_synchronize for GradientSync, by sf_count_window as each window
        ends for DDPSync, whose windows DDP reduces); once the face closed
        (no context), the last count it read."""
        if self.context is None:
            return self._closed_windows
        return self._plugin_windows()

    def _plugin_windows(self):
        raise NotImplementedError  # the live count, the context open

    def _keep_windows(self):
        """Before the face lets its context go: the count ``windows`` answers after."""
        if self.context is not None:
            self._closed_windows = self._plugin_windows()

    @property
    def _passes(self):
        return self._window.passes

    def is_step(self):
        """True once the window's last backward pass has synchronized (every
        .grad holds the reduced gradient on every rank), until the next
        backward pass starts: the time to clip, unscale and step."""
        return self._window.step_ready

    def set_accumulation_steps(self, n):
        """Windows of ``n`` backward passes from the next window on (now if
        no pass of the current window has started), e.g. an epoch's shorter
        last window. Every rank must call it at the same point."""
        check_counts("set_accumulation_steps", n, None)
        if n is None or not self.accumulation_steps:
            raise ValueError("set_accumulation_steps: %r (%s was made without "
                             "accumulation_steps: its windows come from no_sync())"
                             % (n, type(self).__name__))
        self._window.set_accumulation_steps(n)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: the forward and backward passes inside it
        stay local (their gradients sum into .grad, nothing is sent); the
        first backward pass outside synchronizes the window at its end.
        Trainer frameworks call it (Accelerate's accumulate(), Lightning,
        the HF Trainer); with ``accumulation_steps`` too, the host's windows
        must agree with it in the first window (RuntimeError otherwise)."""
        self._verify_if_due()  # before the window's forwards move the buffers
        outer = self._host_inside
        self._host_inside = True
        set_window(self.context, True)
        try:
            yield self
        finally:
            self._host_inside = outer
            if not outer and self.context is not None and self.context.in_accumulation():
                self.context.end_accumulation()

    accumulate = no_sync  # sfsync's own name for it

    def _verify_if_due(self):
        """verify_every: once every verify_every windows, outside a window,
        compare the replicas (GradientSync and DDPSync). GradientSync calls it at
        a window's first forward and on entering accumulate(), before any forward
        of the window moved a buffer (verify_buffers), and at later forwards;
        DDPSync at the wrapped module's forward, after DDP's buffer broadcast."""
        if (self._verifier is not None and self.windows - self._last_verified >= self._verify_every
                and not self.context.in_accumulation()):
            self._last_verified = self.windows
            self._verifier.check(self.windows)

    def _face_state_dict(self, kind):
        """state_dict() of GradientSync and DDPSync (see GradientSync.state_dict)."""
        if not self._at_window_boundary():
            raise RuntimeError("%s.state_dict(): called inside a window (%d backward passes of it "
                               "done): save at a step, when is_step() is True"
                               % (kind, self._passes))
        return {"format": _STATE_FORMAT, "kind": kind, "windows": self.windows,
                "accumulation_steps": self.accumulation_steps, "verify_every": self._verify_every,
                "last_verified": self._last_verified,
                "checks": self._verifier.checks if self._verifier is not None else 0}

    def _restore_plugin_windows(self, who, windows):
        """The plugin's count (stats' windows_completed, the window numbers
        its out-of-step check compares; its one holder) goes on from the
        saved one (sf_restore_windows): RuntimeError once this context has
        started."""
        try:
            self.context.restore_windows(windows)
        except sfsync.InvalidStateError as e:
            raise RuntimeError("%s: the plugin holds the window count (%s): load the state "
                               "before the first backward pass" % (who, e)) from None

    def _face_load_state_dict(self, kind, state):
        """load_state_dict() of GradientSync and DDPSync: ValueError naming the
        key for a state that is not one of ours or does not fit this object."""
        who = "%s.load_state_dict" % kind
        if not isinstance(state, dict):
            raise TypeError("%s: expected the dict state_dict() returned, not %s"
                            % (who, type(state).__name__))
        if state.get("format") != _STATE_FORMAT or state.get("kind") not in ("GradientSync",
                                                                             "DDPSync"):
            raise ValueError("%s: not an sfsync state (format %r, kind %r; expected format %d)"
                             % (who, state.get("format"), state.get("kind"), _STATE_FORMAT))
        for key in ("windows", "last_verified", "checks"):
            value = state.get(key)
            if not isinstance(value, int) or value < 0:
                raise ValueError("%s: state[%r] = %r is not an integer >= 0" % (who, key, value))
        if state["last_verified"] > state["windows"]:
            raise ValueError("%s: state['last_verified'] = %d is after state['windows'] = %d"
                             % (who, state["last_verified"], state["windows"]))
        if state.get("accumulation_steps") != self.accumulation_steps:
            raise ValueError("%s: the state was saved with accumulation_steps=%r, this object has "
                             "accumulation_steps=%r: a resumed run must count windows the same way"
                             % (who, state.get("accumulation_steps"), self.accumulation_steps))
        if not self._at_window_boundary():
            raise RuntimeError("%s: called inside a window (%d backward passes of it done): load "
                               "before training resumes" % (who, self._passes))
        if state.get("verify_every") != self._verify_every:
            log(sfsync.LOG_INFO, "%s: verify_every was %r, is now %r" % (
                who, state.get("verify_every"), self._verify_every))
        self._restore_plugin_windows(who, state["windows"])  # restored there, or refused
        self._last_verified = state["last_verified"]
        if self._verifier is not None:
            self._verifier.checks = state["checks"]
