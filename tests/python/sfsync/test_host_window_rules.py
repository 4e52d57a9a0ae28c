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
from sfsync.host_window import HostWindow  # noqa: E402


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
