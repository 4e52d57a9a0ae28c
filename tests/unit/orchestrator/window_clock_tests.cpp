// The WindowClock on its own (plugin/orchestrator/window_clock.h): the
// window number each synchronization sends, under both numbering rules and
// in both kinds of host (one that reports grad-ready, one that reports
// nothing), and the window calls' counters. No context, no ranks: each case
// plays a host's calls against one clock and asserts the exact numbers.

#include <boost/test/unit_test.hpp>

#include <string>

#include "plugin/orchestrator/window_clock.h"

using namespace sfsync;

namespace {

// grad-ready as the Context and the reducer call it: the window number of
// the pass it opens (or joins), or -1 inside a window.
int64_t ready(WindowClock& c) {
  int64_t nth = 0;
  return c.gradReady(&nth) ? c.openPass().window : -1;
}

// One accumulation window of `passes` micro-batches of `grads` gradients.
void window(WindowClock& c, int passes, int grads) {
  c.begin();
  for (int i = 0; i < passes * grads; ++i) BOOST_REQUIRE(ready(c) == -1);
  c.end(grads);
}

// A synchronization as the Context does it: the current number, then done.
int64_t sync(WindowClock& c) {
  const int64_t n = c.current();
  c.synchronized(n);
  return n;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(window_clock_tests)

BOOST_AUTO_TEST_CASE(windows_are_numbered_from_one_by_their_synchronizations) {
  WindowClock c;
  BOOST_TEST(c.current() == 1);  // nothing yet: the first window
  for (int64_t k = 1; k <= 5; ++k) {
    window(c, 3, 2);
    BOOST_TEST(ready(c) == k);  // the last micro-batch, outside
    BOOST_TEST(ready(c) == k);
    BOOST_TEST(sync(c) == k);
  }
  BOOST_TEST(c.windowsBegun() == 5);
  BOOST_TEST(c.windowsEnded() == 5);
  BOOST_TEST(c.windowsCompleted() == 5);
  BOOST_TEST(c.deferredPasses() == 15);      // 3 passes of 2 gradients, 5 times
  BOOST_TEST(c.deferredReadyCalls() == 30);
}

// Rule "consecutive windows are one": a host that reports gradients and
// brackets its micro-batches one by one (begin, pass, end; begin, pass, end;
// then the last pass outside and a synchronization) synchronizes ONE window.
// Broken rule (every begin counts): this synchronization would send 4.
BOOST_AUTO_TEST_CASE(consecutive_windows_are_one_in_a_host_that_reports_gradients) {
  WindowClock c;
  for (int micro = 0; micro < 3; ++micro) window(c, 1, 2);
  BOOST_TEST(c.current() == 1);
  BOOST_TEST(ready(c) == 1);
  BOOST_TEST(ready(c) == 1);
  BOOST_TEST(sync(c) == 1);
  // And again for the next window: still one per synchronization.
  for (int micro = 0; micro < 4; ++micro) window(c, 1, 2);
  BOOST_TEST(sync(c) == 2);
  BOOST_TEST(c.windowsBegun() == 7);  // the counter counts every begin all the same
  BOOST_TEST(c.windowsCompleted() == 2);
}

// The other side of the same rule: a host that reports nothing cannot be
// told apart from one that skipped a synchronization, so each begin counts
// (and the ranks' numbers differ when one skipped). Broken the other way
// (consecutive windows are one in every host): 2 would be 1.
BOOST_AUTO_TEST_CASE(each_begin_counts_in_a_host_that_reports_nothing) {
  WindowClock c;
  c.begin();
  c.end(0);
  c.begin();
  c.end(0);
  BOOST_TEST(c.current() == 2);
  BOOST_TEST(sync(c) == 2);
  c.begin();
  c.end(0);
  BOOST_TEST(sync(c) == 3);
}

// Rule "an extra synchronization reuses the previous number": in a host that
// reports gradients, a synchronization with neither a begin nor a grad-ready
// since the last one is not a window and claims the last number again.
// Broken rule (every synchronization is a window): the second sync sends 2.
BOOST_AUTO_TEST_CASE(an_extra_synchronization_reuses_the_previous_number) {
  WindowClock c;
  window(c, 2, 3);
  BOOST_TEST(sync(c) == 1);
  BOOST_TEST(c.current() == 1);
  BOOST_TEST(sync(c) == 1);  // the extra one
  BOOST_TEST(sync(c) == 1);  // and another
  // A real window after them is the next number, not 1 + the extras.
  window(c, 1, 3);
  BOOST_TEST(sync(c) == 2);
  // So is an implicit window (grad-ready outside, no begin).
  BOOST_TEST(ready(c) == 3);
  BOOST_TEST(sync(c) == 3);
  BOOST_TEST(c.windowsCompleted() == 5);
}

// Without grad-ready the extra synchronization cannot be told from an
// implicit window of one micro-batch: each synchronization is one more.
BOOST_AUTO_TEST_CASE(each_synchronization_is_a_window_in_a_host_that_reports_nothing) {
  WindowClock c;
  BOOST_TEST(sync(c) == 1);
  BOOST_TEST(sync(c) == 2);
  BOOST_TEST(sync(c) == 3);
}

// Grad-ready outside a window belongs to the implicit window the next
// synchronization completes; a begin after such a pass still opens the next
// window (the pass ran outside the windows).
BOOST_AUTO_TEST_CASE(a_pass_outside_then_windows_is_one_window_number_per_begin_after_it) {
  WindowClock c;
  BOOST_TEST(ready(c) == 1);  // implicit window 1, not synchronized yet
  c.begin();                                // begun since sync: 1 -> the number is 0 + 1
  BOOST_TEST(ready(c) == -1);
  c.end(1);
  BOOST_TEST(c.current() == 1);
  c.begin();  // consecutive: the same window
  c.end(1);
  BOOST_TEST(sync(c) == 1);
}

BOOST_AUTO_TEST_CASE(grad_ready_inside_a_window_is_counted_not_numbered) {
  WindowClock c;
  c.begin();
  BOOST_TEST(c.inWindow());
  for (int i = 0; i < 7; ++i) BOOST_TEST(ready(c) == -1);
  c.end(3);  // 7 calls of 3 gradients: 2 whole passes
  BOOST_TEST(!c.inWindow());
  BOOST_TEST(c.deferredReadyCalls() == 7);
  BOOST_TEST(c.deferredPasses() == 2);
  c.begin();
  c.end(0);  // no gradient registered: no pass counted, no division
  BOOST_TEST(c.deferredPasses() == 2);
  // Each window counts its own calls (the 7th call's remainder is not carried).
  c.begin();
  for (int i = 0; i < 2; ++i) ready(c);
  c.end(3);
  BOOST_TEST(c.deferredPasses() == 2);
  BOOST_TEST(c.deferredReadyCalls() == 9);
}

BOOST_AUTO_TEST_CASE(a_refused_begin_changes_nothing_but_its_counters) {
  // The Context asks refuseBegin() instead of begin() inside a window.
  WindowClock d;
  d.begin();
  BOOST_TEST(d.refuseBegin() == 1);  // window 1 is open
  BOOST_TEST(d.refuseBegin() == 1);
  BOOST_TEST(d.refusedBegins() == 2);
  BOOST_TEST(d.refusedBeginWindow() == 1);
  BOOST_TEST(d.windowsBegun() == 1);
  BOOST_TEST(d.inWindow());
  d.end(1);
  BOOST_TEST(sync(d) == 1);
  d.begin();
  BOOST_TEST(d.refuseBegin() == 2);
  BOOST_TEST(d.refusedBeginWindow() == 2);
  BOOST_TEST(d.refusedBegins() == 3);
}

// Restarts: a resumed run's clock continues the saved count. The count of
// windows completed and the numbers go on from it; the begins counted are
// this clock's own. Broken restore (the count only, not the number): the
// first synchronization would send 1, not 42.
BOOST_AUTO_TEST_CASE(a_restored_clock_continues_the_count_and_the_numbers) {
  WindowClock c;
  BOOST_TEST(!c.started());
  BOOST_TEST(c.restore(41));
  BOOST_TEST(c.windowsCompleted() == 41);
  BOOST_TEST(c.current() == 42);
  BOOST_TEST(!c.started());  // restoring is not a window call
  for (int64_t k = 42; k <= 44; ++k) {
    window(c, 2, 3);
    for (int g = 0; g < 3; ++g) BOOST_TEST(ready(c) == k);
    BOOST_TEST(sync(c) == k);
  }
  BOOST_TEST(c.windowsCompleted() == 44);
  BOOST_TEST(c.windowsBegun() == 3);
  // The numbering rules apply from the restored number on: an extra
  // synchronization reuses 44, the next window is 45.
  BOOST_TEST(sync(c) == 44);
  BOOST_TEST(c.windowsCompleted() == 45);
  window(c, 1, 3);
  BOOST_TEST(sync(c) == 45);
}

// In a host that reports nothing, each synchronization is one more, from
// the restored number; a second restore before any window call replaces the
// first, and restoring 0 is a fresh clock.
BOOST_AUTO_TEST_CASE(a_second_restore_before_the_first_window_replaces_the_first) {
  WindowClock c;
  BOOST_TEST(c.restore(1000));
  BOOST_TEST(c.restore(7));
  BOOST_TEST(c.windowsCompleted() == 7);
  BOOST_TEST(sync(c) == 8);
  BOOST_TEST(sync(c) == 9);
  BOOST_TEST(c.windowsCompleted() == 9);
  WindowClock z;
  BOOST_TEST(z.restore(0));
  BOOST_TEST(sync(z) == 1);
  BOOST_TEST(z.windowsCompleted() == 1);
}

// Once a window call used the clock (a begin, a grad-ready inside or
// outside a window, a number claimed by a synchronization, also one that
// then failed) the numbers may already be on the wire: restore refuses and
// changes nothing.
BOOST_AUTO_TEST_CASE(restore_is_refused_once_the_clock_started) {
  const char* starters[] = {"begin", "grad-ready outside", "grad-ready inside", "claim",
                            "synchronized"};
  for (const char* what : starters) {
    BOOST_TEST_CONTEXT(what) {
      WindowClock c;
      const std::string w = what;
      int64_t claimed = -1;
      if (w == "begin") c.begin();
      if (w == "grad-ready outside") BOOST_TEST(ready(c) == 1);
      if (w == "grad-ready inside") {
        c.begin();
        BOOST_TEST(ready(c) == -1);
        c.end(1);
      }
      if (w == "claim") claimed = c.claim().window;  // a synchronization that failed
      if (w == "synchronized") BOOST_TEST(sync(c) == 1);
      BOOST_TEST(c.started());
      const int64_t completed = c.windowsCompleted();
      const int64_t next = c.current();
      BOOST_TEST(!c.restore(50));
      BOOST_TEST(c.windowsCompleted() == completed);
      BOOST_TEST(c.current() == next);
      if (w == "claim") BOOST_TEST(claimed == 1);
    }
  }
}

// The passes the clock hands the reducer (pass_ref.h): a begin, a grad-ready
// outside a window or a claim opens the next; only a synchronization closes
// it; a closed pass keeps its number and its window's until the next opens;
// a restore renumbers windows, not passes. Broken numbering (a pass per
// begin, or a claim that does not open one) fails the exact numbers here.
BOOST_AUTO_TEST_CASE(passes_open_at_the_first_call_and_close_at_their_synchronization) {
  WindowClock c;
  BOOST_TEST(c.restore(10));
  auto is = [&](int64_t number, bool open, int64_t window) {
    const PassRef p = c.pass();
    BOOST_TEST(p.number == number);
    BOOST_TEST(p.open == open);
    BOOST_TEST(p.window == window);
  };
  is(0, false, 10);  // no pass yet
  BOOST_TEST(c.nextPass() == 1);
  // Pass 1: a window of 2 micro-batches, the last micro-batch outside.
  c.begin();
  is(1, true, 11);
  BOOST_TEST(c.nextPass() == 1);  // a second begin would not open another
  PassRef p;
  int64_t nth = 0;
  for (int64_t k = 1; k <= 4; ++k) {
    BOOST_TEST(!c.gradReady(&nth));
    BOOST_TEST(nth == k);  // the window's grad-ready calls
  }
  c.end(2);
  for (int64_t k = 1; k <= 2; ++k) {
    BOOST_TEST(c.gradReady(&nth));
    BOOST_TEST(nth == k);  // those outside, since the last synchronization
    p = c.openPass();      // as the reducer asks, under its lock
    BOOST_TEST(p.number == 1);
    BOOST_TEST(p.open);
    BOOST_TEST(p.window == 11);
  }
  const PassRef claimed = c.claim();
  BOOST_TEST(claimed.number == 1);
  BOOST_TEST(claimed.window == 11);
  c.passSynchronized(claimed);  // as the reducer closes it, under its lock
  is(1, false, 11);  // closed: its results stay the current ones
  BOOST_TEST(c.nextPass() == 2);
  // Pass 2: opened by a grad-ready outside a window (no begin).
  BOOST_TEST(c.gradReady(&nth));
  BOOST_TEST(nth == 1);
  BOOST_TEST(c.openPass().number == 2);
  is(2, true, 12);
  c.synchronized(c.claim().window);
  // Pass 3: opened by the claim of an extra synchronization (the host
  // reported nothing since): it reuses window 12, and is a pass of its own.
  const PassRef extra = c.claim();
  BOOST_TEST(extra.number == 3);
  BOOST_TEST(extra.open);
  BOOST_TEST(extra.window == 12);
  is(3, true, 12);  // what sf_wait_bucket after sf_synchronize_start is handed
  // A failed synchronization closes nothing: the next claim is the same pass.
  BOOST_TEST(c.claim().number == 3);
  c.synchronized(extra.window);
  is(3, false, 12);
  BOOST_TEST(c.windowsCompleted() == 13);
}

BOOST_AUTO_TEST_SUITE_END()
