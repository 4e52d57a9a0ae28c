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
"""

__all__ = ["HostWindow"]


class HostWindow:
    """The window state of one host face; not thread-safe (a training loop
    is one thread)."""

    def __init__(self, who, accumulation_steps=None):
        self.who = who
        self.accumulation_steps = accumulation_steps
        self._next_steps = None
        self.passes = 0            # passes of the current window that ended
        self.windows = 0           # windows synchronized
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
        return True

    def close_window(self):
        """The window is synchronized (by its last pass, or explicitly)."""
        self.passes = 0
        self._decided = None
        self.windows += 1
        self.step_ready = True

    def fail_window(self):
        """The window's synchronization failed and ended it (a weighted
        window of global weight 0): the next pass starts a new window, and
        there is no step (is_step() stays False)."""
        self.passes = 0
        self._decided = None
        self.windows += 1
        self.step_ready = False

    # -- the counter

    def set_accumulation_steps(self, n):
        """N from the next window on (now if no pass of this one started)."""
        if self.at_boundary:
            self.accumulation_steps, self._next_steps = n, None
        else:
            self._next_steps = n
