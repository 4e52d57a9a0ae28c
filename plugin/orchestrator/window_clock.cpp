// WindowClock (window_clock.h): the number a synchronization sends (rule
// "an extra synchronization reuses the previous number") and the restored
// count of a resumed run; the window calls, rule "consecutive windows are
// one" among them (begin), are inline there. No communication and no
// messages here.

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

PassRef WindowClock::claim() {
  claimed_.store(true, std::memory_order_relaxed);
  return openPass();
}

PassRef WindowClock::pass() const {
  const int64_t syncs = syncs_.load(std::memory_order_relaxed);
  if (passOpen_.load(std::memory_order_relaxed)) return PassRef{syncs + 1, true, current()};
  return PassRef{syncs, false, lastNumber_.load(std::memory_order_relaxed)};
}

void WindowClock::synchronized(int64_t number) {
  claimed_.store(true, std::memory_order_relaxed);
  lastNumber_.store(number, std::memory_order_relaxed);
  begunSinceSync_.store(0, std::memory_order_relaxed);
  readyOutsideSinceSync_.store(0, std::memory_order_relaxed);
  windowsCompleted_.fetch_add(1, std::memory_order_relaxed);
  syncs_.fetch_add(1, std::memory_order_relaxed);
  passOpen_.store(false, std::memory_order_relaxed);
}

bool WindowClock::started() const {
  // A begin counts in windowsBegun_, any grad-ready sets hostReportsReady_,
  // a synchronization (also one that failed) claimed or completed a number.
  return windowsBegun_.load(std::memory_order_acquire) > 0 ||
         hostReportsReady_.load(std::memory_order_relaxed) ||
         claimed_.load(std::memory_order_relaxed) || inWindow();
}

bool WindowClock::restore(int64_t completed) {
  if (started()) return false;
  // As if `completed` windows had been synchronized here, the last of them
  // numbered `completed`: the next window is completed + 1 on every rank
  // that restored the same count.
  lastNumber_.store(completed, std::memory_order_relaxed);
  windowsCompleted_.store(completed, std::memory_order_relaxed);
  return true;
}

}  // namespace sfsync
