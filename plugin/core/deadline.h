#pragma once
// Saturating time arithmetic for every wait that timeout_ms bounds: the
// clamp of "forever" values (INT64_MAX, 1e13 ms) and a steady-clock
// deadline whose conversions never overflow. Not responsible for waiting.
//
// Use it wherever a millisecond count becomes a duration or a deadline:
//   Deadline d(opts.timeout_ms);            // instead of now() + milliseconds(ms)
//   cv.wait_until(lock, d.at(), ...);        // or wait_for(d.remaining())
//   ::poll(fds, n, d.pollMs());              // int milliseconds, clamped
//   timeoutDuration(opts.timeout_ms)         // instead of milliseconds(ms)

#include <chrono>
#include <climits>
#include <cstdint>

namespace sfsync {

// The largest timeout honoured: 2^40 ms, about 34.8 years. Larger values
// (INT64_MAX is a common "forever") are clamped to it; in nanoseconds it is
// 1.1e18, so now() + kMaxTimeoutMs (+ any slack) stays far from overflow.
constexpr int64_t kMaxTimeoutMs = int64_t(1) << 40;

// ms clamped to kMaxTimeoutMs. Zero and negative values are returned as
// they are: option validation rejects them with the value in the message.
constexpr int64_t clampTimeoutMs(int64_t ms) { return ms > kMaxTimeoutMs ? kMaxTimeoutMs : ms; }

// The clamped timeout as a duration (negative becomes zero).
inline std::chrono::milliseconds timeoutDuration(int64_t ms) {
  return std::chrono::milliseconds(ms < 0 ? 0 : clampTimeoutMs(ms));
}

// A point on the steady clock, `timeout_ms` (clamped) from its creation.
// Every operation saturates: at() never wraps, remaining() is never negative.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Deadline(int64_t timeoutMs) : at_(saturatingAdd(Clock::now(), timeoutDuration(timeoutMs))) {}
  explicit Deadline(std::chrono::milliseconds timeout) : Deadline(int64_t(timeout.count())) {}

  Clock::time_point at() const { return at_; }
  bool expired() const { return Clock::now() >= at_; }

  // Time left, zero once expired.
  std::chrono::milliseconds remaining() const {
    const auto now = Clock::now();
    if (now >= at_) return std::chrono::milliseconds(0);
    // Round up so that a wait of remaining() does not end just before at().
    return std::chrono::ceil<std::chrono::milliseconds>(at_ - now);
  }

  // remaining() for poll()/epoll_wait(): int milliseconds, at most INT_MAX.
  int pollMs() const {
    const int64_t ms = remaining().count();
    return ms > int64_t(INT_MAX) ? INT_MAX : int(ms);
  }

  // A deadline that is the earlier of this one and `ms` from now.
  Deadline earlier(int64_t ms) const {
    Deadline d(ms);
    if (at_ < d.at_) d.at_ = at_;
    return d;
  }

  // t + d, or the largest time point where that would overflow.
  static Clock::time_point saturatingAdd(Clock::time_point t, std::chrono::milliseconds d) {
    if (d.count() <= 0) return t;
    const auto maxLeft = std::chrono::duration_cast<std::chrono::milliseconds>(
        Clock::time_point::max() - t);
    if (d >= maxLeft) return Clock::time_point::max();
    return t + std::chrono::duration_cast<Clock::duration>(d);
  }

 private:
  Clock::time_point at_;
};

using Clock = std::chrono::steady_clock;

// now + ms as a time point (clamped like every timeout, saturating): for
// code that keeps a bare time point rather than a Deadline.
inline Clock::time_point deadlineAfter(std::chrono::milliseconds ms,
                                       Clock::time_point now = Clock::now()) {
  if (ms.count() <= 0) return now;
  return Deadline::saturatingAdd(now, timeoutDuration(int64_t(ms.count())));
}

// The shortest wait, for "is it there now?" (Gloo's stores read a 0 ms
// timeout as "no timeout").
constexpr std::chrono::milliseconds kStoreProbe(1);

// Whole milliseconds until `deadline` (0 if past, rounded up), for poll(2).
inline int pollMs(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const int64_t left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return left > int64_t(INT_MAX) ? INT_MAX : int(left);
}

}  // namespace sfsync
