#pragma once
// WindowClock: the accumulation windows of one context, and the number of
// the window a synchronization completes. Responsible for the window calls'
// state (begin, end, grad-ready, synchronized), their counters and the two
// numbering rules below, in one place; not for what may be communicated (the
// Context asks it, then drives the reducer), the messages of a refused call,
// or the check of the number across ranks (the reducer's window check).
//
// The window number (what every rank sends with a synchronization):
//  - windows begun since the last synchronization, each one more;
//  - rule "consecutive windows are one": a begin that follows an end with no
//    synchronization between, in a host that reports gradients (some
//    gradReady was seen), opens no new window: such a host brackets its
//    micro-batches one by one, and no pass ran outside the windows. A host
//    that reports nothing cannot be told apart from one that skipped a
//    synchronization, so there each begin counts;
//  - no begin since the last synchronization: an implicit window of one
//    micro-batch (the number one more), except by rule "an extra
//    synchronization reuses the previous number": in a host that reports
//    gradients and reported none since the last synchronization, the
//    synchronization is an extra one and claims the previous number again.
//
// Restarts (restore): a resumed run continues the saved run's count, as if
// its `completed` windows had been synchronized by this clock: the count of
// windows completed and the last number both become `completed`, so the next
// window is number completed + 1. Only on a fresh clock (no begin, no
// grad-ready, no number claimed for a synchronization yet): the numbers the
// ranks already exchanged cannot be renumbered. The count has this one
// owner; the Context only asks.
//
// Passes (pass_ref.h): the clock also numbers the passes, the one count the
// reducer's calls are handed. A pass opens at the first begin, grad-ready
// outside a window or claimed synchronization since the last synchronized
// one; synchronized() closes it. Open: number = synchronizations + 1;
// closed: the last pass, number = synchronizations.
//
// Threads: grad-ready may come from any thread (autograd hooks), and every
// counter is readable from any thread; the window calls themselves (begin,
// end, synchronized, claim, restore) do not race with each other: the
// Context makes them under its window lock (context.h, "Threads"; since
// 0.5 the host may call the entry points from several threads), and
// synchronized() runs inside such a call (restore
// does not race with grad-ready either: it precedes every window call).

#include <atomic>
#include <cstdint>

#include "plugin/reducer/pass_ref.h"

namespace sfsync {

class WindowClock final {
 public:
  bool inWindow() const { return inWindow_.load(std::memory_order_acquire); }

  // ---- The window calls (inline: hooks and training loops call them per
  // micro-batch; current() and synchronized() are in window_clock.cpp) ----
  // A begin inside a window is refused: counted (refusedBegins), and the
  // open window's number returned (as windowsBegun()); nothing else changes.
  int64_t refuseBegin() {
    const int64_t k = windowsBegun_.load(std::memory_order_relaxed);
    refusedBeginWindow_.store(k, std::memory_order_relaxed);
    refusedBegins_.fetch_add(1, std::memory_order_release);
    return k;
  }
  // Opens a window (the caller checked !inWindow() and that the reducer may
  // begin one). Counts the window begun before the state flips, so a reader
  // that sees inWindow() true also sees its count.
  void begin() {
    // Rule "consecutive windows are one": only the first begin since the
    // last synchronization counts in a host that reports gradients.
    if (begunSinceSync_.load(std::memory_order_relaxed) == 0 ||
        !hostReportsReady_.load(std::memory_order_relaxed)) {
      // Window calls do not race with each other: a plain increment, no RMW.
      begunSinceSync_.store(begunSinceSync_.load(std::memory_order_relaxed) + 1,
                            std::memory_order_relaxed);
    }
    readyInWindow_.store(0, std::memory_order_relaxed);
    passOpen_.store(true, std::memory_order_relaxed);
    windowsBegun_.fetch_add(1, std::memory_order_release);
    inWindow_.store(true, std::memory_order_release);
  }
  // Closes the open window (the caller checked inWindow()); `gradients`
  // registered turns its grad-ready calls into deferred passes.
  void end(int64_t gradients) {
    if (gradients > 0) {
      deferredPasses_.fetch_add(readyInWindow_.load(std::memory_order_relaxed) / gradients,
                                std::memory_order_relaxed);
    }
    inWindow_.store(false, std::memory_order_release);
    windowsEnded_.fetch_add(1, std::memory_order_relaxed);
  }
  // A gradient reported ready: inside a window, counted and false
  // (communicate nothing); outside, true (the Context then asks openPass()
  // for the pass it hands the reducer). Either way
  // `*nth` is its place among the grad-ready calls of the open window, or of
  // those outside a window since the last synchronization (1, 2, ...: the
  // trace's passes). Inline: the hot path of every hook.
  bool gradReady(int64_t* nth) {
    if (!hostReportsReady_.load(std::memory_order_relaxed)) {
      hostReportsReady_.store(true, std::memory_order_relaxed);
    }
    if (inWindow_.load(std::memory_order_acquire)) {
      *nth = readyInWindow_.fetch_add(1, std::memory_order_relaxed) + 1;
      deferredReadyCalls_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    *nth = readyOutsideSinceSync_.fetch_add(1, std::memory_order_relaxed) + 1;
    return true;
  }
  // The window a synchronization now would complete (the rules above).
  int64_t current() const;
  // The pass of a synchronization that is about to send current()
  // (sf_synchronize, sf_synchronize_start; its window): opens the pass if
  // none is. From now on the clock is started() even if that
  // synchronization fails.
  PassRef claim();
  // The synchronization of window `number` (what claim() returned) succeeded:
  // it closes the pass.
  void synchronized(int64_t number);
  // Asked by the Context (pass_ref.h): a grad-ready's pass, opened if none
  // is; and, once the reducer synchronized `pass`, synchronized(pass.window).
  PassRef openPass() {
    if (!passOpen_.load(std::memory_order_relaxed)) passOpen_.store(true, std::memory_order_relaxed);
    return PassRef{syncs_.load(std::memory_order_relaxed) + 1, true, current()};
  }
  void passSynchronized(const PassRef& pass) { synchronized(pass.window); }

  // ---- Passes (pass_ref.h) ------------------------------------------------
  // The pass under way, or the last one (see "Passes" above).
  PassRef pass() const;
  // The number of the pass a begin now would open (the caller asks the
  // reducer to open it, then calls begin()).
  int64_t nextPass() const {
    return syncs_.load(std::memory_order_relaxed) + 1;
  }

  // ---- Restarts -----------------------------------------------------------
  // Whether a window call used the clock yet: a begin, a grad-ready (inside
  // or outside a window), a claimed number or a synchronized one.
  bool started() const;
  // Continues a saved run of `completed` (>= 0, the caller checked) windows
  // (see "Restarts" above). False, changing nothing, once started().
  bool restore(int64_t completed);

  // ---- Counters, readable from any thread --------------------------------
  int64_t windowsBegun() const { return windowsBegun_.load(std::memory_order_acquire); }
  int64_t windowsEnded() const { return windowsEnded_.load(std::memory_order_relaxed); }
  int64_t windowsCompleted() const { return windowsCompleted_.load(std::memory_order_relaxed); }
  int64_t refusedBegins() const { return refusedBegins_.load(std::memory_order_acquire); }
  int64_t refusedBeginWindow() const { return refusedBeginWindow_.load(std::memory_order_relaxed); }
  int64_t deferredPasses() const { return deferredPasses_.load(std::memory_order_relaxed); }
  int64_t deferredReadyCalls() const { return deferredReadyCalls_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> inWindow_{false};
  // The number: the last synchronized window's, windows begun since (after
  // rule one), grad-ready calls outside a window since, and whether the host
  // reports gradients at all (both rules apply only then).
  std::atomic<int64_t> lastNumber_{0};
  std::atomic<int64_t> begunSinceSync_{0};
  std::atomic<int64_t> readyOutsideSinceSync_{0};
  std::atomic<bool> hostReportsReady_{false};
  std::atomic<int64_t> readyInWindow_{0};  // grad-ready calls of the open window
  std::atomic<bool> claimed_{false};       // a synchronization claimed or completed a number
  // Passes: successful synchronizations (not restored: this process's), and
  // whether a pass opened since the last.
  std::atomic<int64_t> syncs_{0};
  std::atomic<bool> passOpen_{false};

  std::atomic<int64_t> windowsBegun_{0};
  std::atomic<int64_t> windowsEnded_{0};
  std::atomic<int64_t> windowsCompleted_{0};
  std::atomic<int64_t> refusedBegins_{0};
  std::atomic<int64_t> refusedBeginWindow_{0};
  std::atomic<int64_t> deferredPasses_{0};
  std::atomic<int64_t> deferredReadyCalls_{0};
};

}  // namespace sfsync
