// WindowClock (window_clock.h): the two numbering rules, each in one
// function (begin, current); no communication and no messages here.

#include "plugin/orchestrator/window_clock.h"

namespace sfsync {

int64_t WindowClock::refuseBegin() {
  const int64_t k = windowsBegun_.load(std::memory_order_relaxed);
  refusedBeginWindow_.store(k, std::memory_order_relaxed);
  refusedBegins_.fetch_add(1, std::memory_order_release);
  return k;
}

void WindowClock::begin() {
  // Rule "consecutive windows are one": only the first begin since the last
  // synchronization counts in a host that reports gradients.
  if (begunSinceSync_.load(std::memory_order_relaxed) == 0 ||
      !hostReportsReady_.load(std::memory_order_relaxed)) {
    // Window calls do not race with each other: a plain increment, no RMW.
    begunSinceSync_.store(begunSinceSync_.load(std::memory_order_relaxed) + 1,
                          std::memory_order_relaxed);
  }
  readyInWindow_.store(0, std::memory_order_relaxed);
  windowsBegun_.fetch_add(1, std::memory_order_release);
  inWindow_.store(true, std::memory_order_release);
}

void WindowClock::end(int64_t gradients) {
  if (gradients > 0) {
    deferredPasses_.fetch_add(readyInWindow_.load(std::memory_order_relaxed) / gradients,
                              std::memory_order_relaxed);
  }
  inWindow_.store(false, std::memory_order_release);
  windowsEnded_.fetch_add(1, std::memory_order_relaxed);
}

int64_t WindowClock::current() const {
  const int64_t last = lastNumber_.load(std::memory_order_relaxed);
  const int64_t begun = begunSinceSync_.load(std::memory_order_relaxed);
  if (begun > 0) return last + begun;
  // Rule "an extra synchronization reuses the previous number".
  if (hostReportsReady_.load(std::memory_order_relaxed) &&
      readyOutsideSinceSync_.load(std::memory_order_relaxed) == 0) {
    return last;
  }
  return last + 1;  // an implicit window of one micro-batch
}

void WindowClock::synchronized(int64_t number) {
  lastNumber_.store(number, std::memory_order_relaxed);
  begunSinceSync_.store(0, std::memory_order_relaxed);
  readyOutsideSinceSync_.store(0, std::memory_order_relaxed);
  windowsCompleted_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace sfsync
