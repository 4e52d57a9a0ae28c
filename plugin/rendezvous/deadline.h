#pragma once
// Deadlines for rendezvous waits: steady-clock points built with saturating
// arithmetic, so that a "forever" timeout (INT64_MAX ms) never overflows.

#include <chrono>
#include <algorithm>
#include <climits>

namespace sfsync {

using Clock = std::chrono::steady_clock;

// "Forever" as a deadline: a century, far from any overflow in poll,
// condition variables or further additions.
constexpr std::chrono::milliseconds kFarFuture = std::chrono::hours(24 * 365 * 100);

// now + ms, saturating at now + kFarFuture (no overflow for INT64_MAX ms).
inline Clock::time_point deadlineAfter(std::chrono::milliseconds ms,
                                       Clock::time_point now = Clock::now()) {
  if (ms.count() <= 0) return now;
  return now + std::min(ms, kFarFuture);
}

// Whole milliseconds until `deadline` (0 if past), clamped for poll(2).
inline int pollMs(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
  return left > INT_MAX ? INT_MAX : int(left);
}

}  // namespace sfsync
