// WindowClock (window_clock.h): the number a synchronization sends (rule
// "an extra synchronization reuses the previous number"); the window calls,
// rule "consecutive windows are one" among them (begin), are inline there.
// No communication and no messages here.

#include "plugin/orchestrator/window_clock.h"

namespace sfsync {

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
