"""The accumulation window as a host face sees it (GradientSync, the DDP
attachment, the framework integrations): which backward pass stays local and
which one synchronizes, decided once per pass at its start. Pure logic, no
torch and no library calls: the faces apply the decision to the context.

Two sources decide, with one rule between them (docs/python.md, "Windows
from the host"):

* the host: a pass whose forward runs inside ``no_sync()`` (DDP's, or the
  face's own) stays local; once the host has given that signal, a pass
  outside ``no_sync()`` always synchronizes. A window the host cuts short
  (an epoch's last one) is followed exactly: a synchronization the host asks
  for is never deferred.
* a counter (``accumulation_steps=N``) for hosts that give no signal: passes
  1..N-1 of each window stay local, pass N synchronizes.

With both, the first window the host closes must have N passes, and a host
must not keep deferring past N passes in it: a contradiction is a
RuntimeError at that pass (before its backward), naming both, never a
divergence. Later windows follow the host (a short last window is legal).

* the host's optimizer step, for a face that sees it (``follows_steps``:
  ``attach(ddp)`` without a count, the no-code path of sfsync/torch/follow.py)
  and a host that gives no ``no_sync()`` signal: a step ends the window.
  The last pass's reduction must start during its backward, before the step
  can be seen, so the face guesses (``UNTIL_STEP``: every pass stays local and
  the step reduces them, for a first window whose step the face will see): the window's length is the most frequent
  of the last 8 windows' (ties: the latest; before any step, ``guess``, e.g.
  SF_ACCUMULATION_STEPS, else every pass synchronizes as DDP does). A
  guess too long leaves the window's last passes local: the face reduces
  them at the step (``step()`` says so), one collective per group of
  gradients without overlap. A guess too short synchronized a pass that was
  not the last: the passes after it stay local and are reduced at the step,
  so the window sends twice. Exact either way: an all-reduce is linear, so
  the average of (an average + local sums) is the average of every pass.
"""

import collections

__all__ = ["HostWindow", "UNTIL_STEP", "GUESS_HISTORY"]

#: How many windows' lengths the guess looks back on.
GUESS_HISTORY = 8
#: A guess that keeps every pass local until the step reduces them.
UNTIL_STEP = 0


class HostWindow:
    """The window state of one host face; not thread-safe (a training loop
    is one thread)."""

    def __init__(self, who, accumulation_steps=None, guess=None, on_close=None):
        self.who = who
        self.accumulation_steps = accumulation_steps
        self.follows_steps = False  # the face sees the optimizer step: it ends a window
        self.guess = guess          # the first window's guessed length (follows_steps)
        self.pending = False        # a pass the host would have sent stayed local since the
                                    # window's last synchronized pass: reduce it at the step
        self.lengths = collections.deque(maxlen=GUESS_HISTORY)  # passes per window, by steps
        self._next_steps = None
        self.passes = 0            # passes of the current window that ended
        # Windows are counted by the plugin, their one holder
        # (sf_stats.windows_completed): at sf_synchronize (GradientSync), or,
        # for a face whose windows the host reduces (DDPSync: DDP's own
        # process group), by ``on_close`` (sf_count_window) as each ends.
        self.on_close = on_close
        self.step_ready = False    # the window's last pass synchronized; no pass since
        self.host_signal = False   # the host used no_sync() at least once: it decides
        self._checked = False      # the first window decided by the host agreed with N
        self._decided = None       # the current pass: None (no pass open), True (local), False

    # -- the pass

    @property
    def pass_open(self):
        return self._decided is not None

    @property
    def at_boundary(self):
        """No pass of the current window has started."""
        return self.passes == 0 and self._decided is None

    def begin_pass(self, host_inside):
        """A training forward starts a pass (or continues the open one):
        True if the pass stays local, False if it synchronizes at its end.
        ``host_inside``: the host's no_sync() is active."""
        if self._decided is not None:
            return self._decided
        if self.at_boundary and self._next_steps is not None:
            self.accumulation_steps, self._next_steps = self._next_steps, None
        n = self.accumulation_steps
        if host_inside:
            self.host_signal = True
            if n and not self._checked and self.passes + 1 >= n:
                raise RuntimeError(
                    "%s: accumulation_steps=%d, but the host keeps micro-batch %d of its first "
                    "window inside no_sync(): the host's windows are longer than %d; pass "
                    "accumulation_steps=None to follow the host, or make them agree"
                    % (self.who, n, self.passes + 1, n))
            local = True
        elif self.host_signal or not n:
            if n and not self._checked and self.passes + 1 != n:
                raise RuntimeError(
                    "%s: accumulation_steps=%d, but the host synchronizes after %d micro-"
                    "batches in its first window (outside no_sync()): the host decides the "
                    "windows; pass accumulation_steps=None to follow it, or make them agree"
                    % (self.who, n, self.passes + 1))
            local = False
            if not n and not self.host_signal and self.follows_steps:
                length = self.guessed_length()
                local = length is not None and self.passes + 1 != length
        else:
            local = self.passes < n - 1
        self._decided = local
        self.step_ready = False
        return local

    def end_pass(self):
        """The open pass's backward ended: True if it was the window's last
        (the face synchronizes, then calls close_window())."""
        local, self._decided = self._decided, None
        if local is None:
            return False
        if local:
            self.passes += 1
            return False
        if self.host_signal:
            self._checked = True
        elif self.stepped_windows:
            # The step ends the window: a synchronized pass is final until
            # another pass adds to .grad.
            self.passes += 1
            self.pending = False
            self.step_ready = True
            return False
        return True

    @property
    def stepped_windows(self):
        """Windows end at the host's optimizer step (no no_sync() signal, no
        count, a face that sees the step)."""
        return self.follows_steps and not self.host_signal and not self.accumulation_steps

    def guessed_length(self):
        """The window length the step-ended windows suggest, or ``guess``."""
        if not self.lengths:
            return self.guess
        counts = collections.Counter(self.lengths)
        most = max(counts.values())
        return next(n for n in reversed(self.lengths) if counts[n] == most)

    def step(self):
        """The host's optimizer is about to step. True when a pass stayed
        local since the window's last synchronized one (``pending``): the face
        must reduce .grad now, before the step reads it. With step-ended
        windows the step closes the window and its length is remembered; a
        window that a synchronized pass already closed is not counted twice."""
        catch_up, self.pending = self.pending, False
        if self._decided is not None:  # a pass whose backward did not finish
            return catch_up
        if self.stepped_windows or (catch_up and self.passes):
            if self.passes:
                if self.stepped_windows:
                    self.lengths.append(self.passes)
                self.close_window()
        return catch_up

    def close_window(self):
        """The window is synchronized (by its last pass, or explicitly)."""
        self.pending = False
        self.passes = 0
        self._decided = None
        if self.on_close is not None:
            self.on_close()
        self.step_ready = True

    def fail_window(self):
        """The window's synchronization failed and ended it (a weighted
        window of global weight 0): the next pass starts a new window, and
        there is no step (is_step() stays False)."""
        self.passes = 0
        self._decided = None
        if self.on_close is not None:
            self.on_close()
        self.step_ready = False

    # -- the counter

    def set_accumulation_steps(self, n):
        """N from the next window on (now if no pass of this one started)."""
        if self.at_boundary:
            self.accumulation_steps, self._next_steps = n, None
        else:
            self._next_steps = n
