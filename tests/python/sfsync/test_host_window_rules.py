"""sfsync.host_window.HostWindow on its own (no torch, no library): every
rule of the window a host face follows, one case each, each able to fail."""

import os
import sys
import unittest

# This folder holds torch/ (the tests of sfsync.torch): off sys.path, or where no
# torch is installed `import torch` would find that folder (a namespace package).
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".")
               != os.path.realpath(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
from sfsync.host_window import UNTIL_STEP  # noqa: E402
from sfsync.host_window import HostWindow as _HostWindow  # noqa: E402


class HostWindow(_HostWindow):
    """A HostWindow whose ``on_close`` counts the windows it ends (the faces
    count them in the plugin: sf_synchronize, sf_count_window)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, on_close=self._closed, **kwargs)
        self.windows = 0

    def _closed(self):
        self.windows += 1


def run(window, plan):
    """plan: a string of passes, 'i' inside the host's no_sync(), 'o'
    outside; returns the string of decisions, 'L' local, 'S' synchronized,
    with '|' after each window the pass closed."""
    out = []
    for p in plan:
        local = window.begin_pass(p == "i")
        out.append("L" if local else "S")
        if window.end_pass():
            window.close_window()
            out.append("|")
    return "".join(out)


class HostDecides(unittest.TestCase):
    def test_no_counter_follows_no_sync_exactly(self):
        w = HostWindow("t")
        self.assertEqual(run(w, "iiio" "iiio" "io" "o"), "LLLS|LLLS|LS|S|")
        self.assertEqual(w.windows, 4)

    def test_counter_agreeing_host_short_last_window_followed(self):
        w = HostWindow("t", 4)
        self.assertEqual(run(w, "iiio" "iiio" "io"), "LLLS|LLLS|LS|")

    def test_a_sync_the_host_asks_for_is_never_deferred(self):
        w = HostWindow("t", 4)
        run(w, "iiio")  # the first window agrees: the host decides from now on
        self.assertEqual(run(w, "o"), "S|")

    def test_host_closing_the_first_window_early_is_an_error_naming_both(self):
        w = HostWindow("t", 4)
        run(w, "ii")
        with self.assertRaisesRegex(RuntimeError, r"accumulation_steps=4, but the host "
                                    r"synchronizes after 3 micro-batches"):
            w.begin_pass(False)

    def test_host_deferring_past_n_in_the_first_window_is_an_error(self):
        w = HostWindow("t", 2)
        run(w, "i")
        with self.assertRaisesRegex(RuntimeError, r"accumulation_steps=2, but the host keeps "
                                    r"micro-batch 2 of its first window inside no_sync"):
            w.begin_pass(True)


class Counter(unittest.TestCase):
    def test_counter_without_signal(self):
        w = HostWindow("t", 3)
        self.assertEqual(run(w, "oooooo"), "LLS|LLS|")

    def test_set_accumulation_steps_takes_effect_from_the_next_window(self):
        w = HostWindow("t", 3)
        run(w, "o")
        w.set_accumulation_steps(2)  # inside the open window: this one stays 3
        self.assertEqual(run(w, "oo"), "LS|")
        self.assertEqual(run(w, "oo"), "LS|")

    def test_set_accumulation_steps_at_a_boundary_is_now(self):
        w = HostWindow("t", 3)
        w.set_accumulation_steps(1)
        self.assertEqual(run(w, "oo"), "S|S|")


def run_steps(window, plan):
    """As run(), where 's' is the host's optimizer step: '!' after a step
    that must reduce what stayed local first (a catch-up), '|' after a step
    that ends a window without one."""
    out = []
    for p in plan:
        if p == "s":
            out.append("!" if window.step() else "|")
            continue
        local = window.begin_pass(p == "i")
        if local and p == "o":
            window.pending = True  # the face: DDP would have sent it
        out.append("L" if local else "S")
        if window.end_pass():
            window.close_window()
            out.append("|")
    return "".join(out)


def stepped(guess=None):
    w = HostWindow("t", guess=guess)
    w.follows_steps = True
    return w


class StepsDecide(unittest.TestCase):
    """A host that never calls no_sync(): the optimizer step ends a window,
    the length is guessed, a wrong guess is reduced at the step."""

    def test_before_any_step_every_pass_synchronizes(self):
        w = stepped()
        self.assertEqual(run_steps(w, "oooos"), "SSSS|")
        self.assertEqual(list(w.lengths), [4])
        self.assertEqual(w.windows, 1)

    def test_the_guess_sends_the_windows_last_pass_only(self):
        w = stepped()
        run_steps(w, "oooos")
        self.assertEqual(run_steps(w, "oooos" "oooos"), "LLLS|LLLS|")
        self.assertEqual(w.windows, 3)

    def test_a_short_window_is_reduced_at_its_step(self):
        w = stepped(guess=4)
        self.assertEqual(run_steps(w, "oooos" "oooos" "ooos" "oooos"), "LLLS|LLLS|LLL!LLLS|")
        self.assertEqual(w.windows, 4)

    def test_a_long_window_sends_at_the_guess_and_again_at_its_step(self):
        w = stepped(guess=2)
        self.assertEqual(run_steps(w, "oos" "oooos"), "LS|LSLL!")

    def test_the_guess_is_the_most_frequent_recent_length_ties_the_latest(self):
        w = stepped(guess=4)
        run_steps(w, "oooos" "oooos" "ooos")
        self.assertEqual(w.guessed_length(), 4)  # 4, 4, 3
        run_steps(w, "ooos")
        self.assertEqual(w.guessed_length(), 3)  # 4, 4, 3, 3: a tie, the latest

    def test_until_step_keeps_every_pass_local(self):
        w = stepped(guess=UNTIL_STEP)
        self.assertEqual(run_steps(w, "oooos"), "LLLL!")
        self.assertEqual(w.guessed_length(), 4)

    def test_a_step_with_no_pass_counts_nothing(self):
        w = stepped()
        run_steps(w, "oos")
        self.assertEqual(run_steps(w, "s"), "|")  # a second optimizer
        self.assertEqual((w.windows, list(w.lengths)), (1, [2]))

    def test_no_sync_signal_wins_over_the_guess(self):
        w = stepped(guess=4)
        # The host steps inside its own no_sync(): what DDP would not have sent
        # either stays local (no catch-up), and the window goes on.
        self.assertEqual(run_steps(w, "iis"), "LL|")
        self.assertEqual(run_steps(w, "io" "s"), "LS||")

    def test_without_follows_steps_a_step_changes_nothing(self):
        w = HostWindow("t")
        self.assertEqual(run_steps(w, "oos"), "S|S||")
        self.assertEqual(w.windows, 2)


class PassState(unittest.TestCase):
    def test_the_decision_is_taken_once_per_pass(self):
        w = HostWindow("t")
        self.assertTrue(w.begin_pass(True))
        self.assertTrue(w.begin_pass(False))  # a second forward of the same pass
        self.assertFalse(w.end_pass())
        self.assertFalse(w.end_pass())  # no pass open: nothing happens
        self.assertEqual(w.passes, 1)

    def test_step_ready_until_the_next_pass(self):
        w = HostWindow("t")
        run(w, "o")
        self.assertTrue(w.step_ready)
        w.begin_pass(True)
        self.assertFalse(w.step_ready)
        self.assertFalse(w.at_boundary)


if __name__ == "__main__":
    unittest.main()
