// plugin/backend/nccl/completion_poll.h: how the NCCL module waits for the
// GPU (done, failed, timed out), with fake completions and a fake clock.

#include "plugin/backend/nccl/completion_poll.h"

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <vector>

using sfsync::nccl::Outcome;
using sfsync::nccl::Poll;
using sfsync::nccl::pollUntil;

namespace {

// A clock that advances only when the poller sleeps.
struct FakeClock {
  using duration = std::chrono::microseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<FakeClock>;
  static constexpr bool is_steady = true;
  static time_point now() { return time_point(duration(nowUs)); }
  static int64_t nowUs;
};
int64_t FakeClock::nowUs = 0;

struct Recorder {
  std::vector<int64_t> sleeps;
  void operator()(std::chrono::microseconds d) {
    sleeps.push_back(d.count());
    FakeClock::nowUs += d.count() == 0 ? 1 : d.count();
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(completion_poll_tests)

BOOST_AUTO_TEST_CASE(done_after_a_few_polls) {
  FakeClock::nowUs = 0;
  int polls = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([&] { return ++polls == 5 ? Poll::kDone : Poll::kPending; },
                                         [] { return Poll::kPending; }, std::chrono::milliseconds(10),
                                         std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kDone));
  BOOST_TEST(polls == 5);
  BOOST_TEST(sleep.sleeps.size() == 4u);
}

BOOST_AUTO_TEST_CASE(health_is_checked_again_after_the_completion) {
  // The communicator fails while the work completes (NCCL raises its
  // asynchronous error independently of the event): the poll says failed.
  FakeClock::nowUs = 0;
  int checks = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([] { return Poll::kDone; },
                                         [&] { return ++checks >= 2 ? Poll::kFailed : Poll::kPending; },
                                         std::chrono::milliseconds(10), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kFailed));
  BOOST_TEST(checks == 2);
  BOOST_TEST(sleep.sleeps.empty());
}

BOOST_AUTO_TEST_CASE(health_failure_wins_even_while_the_completion_never_comes) {
  FakeClock::nowUs = 0;
  int checks = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([] { return Poll::kPending; },
                                         [&] { return ++checks == 3 ? Poll::kFailed : Poll::kPending; },
                                         std::chrono::milliseconds(10), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kFailed));
  BOOST_TEST(checks == 3);
}

BOOST_AUTO_TEST_CASE(health_is_checked_before_a_finished_completion) {
  // A collective whose event fired but whose communicator reported an
  // asynchronous error must not count as done: its data may be garbage.
  FakeClock::nowUs = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([] { return Poll::kDone; }, [] { return Poll::kFailed; },
                                         std::chrono::milliseconds(10), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kFailed));
}

BOOST_AUTO_TEST_CASE(completion_failure_is_reported) {
  FakeClock::nowUs = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([] { return Poll::kFailed; }, [] { return Poll::kPending; },
                                         std::chrono::milliseconds(10), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kFailed));
}

BOOST_AUTO_TEST_CASE(times_out_at_the_deadline_not_before) {
  FakeClock::nowUs = 0;
  Recorder sleep;
  int64_t lastPollAt = -1;
  const Outcome o = pollUntil<FakeClock>(
      [&] {
        lastPollAt = FakeClock::nowUs;
        return Poll::kPending;
      },
      [] { return Poll::kPending; }, std::chrono::milliseconds(50), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kTimedOut));
  BOOST_TEST(FakeClock::nowUs >= 50000);
  BOOST_TEST(lastPollAt >= 50000);  // the last check came at or after the deadline
  BOOST_TEST(FakeClock::nowUs <= 50000 + 200);  // overshoot at most one pause
}

BOOST_AUTO_TEST_CASE(pauses_grow_and_are_capped) {
  FakeClock::nowUs = 0;
  Recorder sleep;
  pollUntil<FakeClock>([] { return Poll::kPending; }, [] { return Poll::kPending; },
                       std::chrono::milliseconds(20), std::ref(sleep), std::chrono::microseconds(100));
  BOOST_TEST_REQUIRE(sleep.sleeps.size() > 80u);
  for (size_t i = 0; i < 64; ++i) BOOST_TEST(sleep.sleeps[i] == 0);  // yields first
  BOOST_TEST(sleep.sleeps[64] == 1);
  BOOST_TEST(sleep.sleeps[65] == 2);
  int64_t largest = 0;
  for (int64_t s : sleep.sleeps) largest = std::max(largest, s);
  BOOST_TEST(largest == 100);
}

BOOST_AUTO_TEST_CASE(zero_timeout_still_polls_once) {
  FakeClock::nowUs = 0;
  Recorder sleep;
  const Outcome o = pollUntil<FakeClock>([] { return Poll::kDone; }, [] { return Poll::kPending; },
                                         std::chrono::milliseconds(0), std::ref(sleep));
  BOOST_TEST(int(o) == int(Outcome::kDone));
}

BOOST_AUTO_TEST_SUITE_END()
