#pragma once
// Documented time bounds: runs a body on its own thread, waits for it at most
// a limit (a body that hangs is left behind so that the suite goes on), and
// checks that it ended with an expected status within timeout_ms plus the
// documented slack (docs/reliability.md, "Every wait ends": 2 s).

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "sfsync.h"

namespace sftest {

// The slack every documented wait may take beyond its timeout.
constexpr double kSlackSeconds = 2.0;
// Starting a process and loading the library on a busy machine: added where
// a bound is measured from outside a child process.
constexpr double kStartSeconds = 3.0;

struct Bounded {
  bool finished = false;
  sf_status status = SF_OK;
  std::string message;
  double seconds = 0;  // from the call of boundedRun to the body's end
};

// Runs body(out) on its own thread (the body sets out.status and
// out.message) and waits at most limitSeconds for it.
inline Bounded boundedRun(std::function<void(Bounded&)> body, double limitSeconds) {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    Bounded out;
  };
  auto shared = std::make_shared<Shared>();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread([shared, body, t0] {
    Bounded o;
    body(o);
    o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    o.finished = true;
    std::lock_guard<std::mutex> lock(shared->m);
    shared->out = o;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->m);
  shared->cv.wait_for(lock, std::chrono::duration<double>(limitSeconds),
                      [&] { return shared->out.finished; });
  Bounded o = shared->out;
  if (!o.finished) {
    o.seconds = limitSeconds;
    o.message = "still waiting after " + std::to_string(limitSeconds) + " s";
  }
  return o;
}

// An ABI call: its status, and sf_last_error() of the thread that made it.
inline Bounded boundedCall(std::function<sf_status()> call, double limitSeconds) {
  return boundedRun(
      [call](Bounded& o) {
        o.status = call();
        if (o.status != SF_OK) o.message = sf_last_error();
      },
      limitSeconds);
}

// The body ended, with one of the `ok` statuses, within timeoutSeconds + the
// slack.
inline void expectBounded(const Bounded& o, double timeoutSeconds,
                          std::initializer_list<sf_status> ok) {
  BOOST_TEST(o.finished, o.message);
  bool statusOk = false;
  for (sf_status s : ok) statusOk = statusOk || o.status == s;
  BOOST_TEST(statusOk, "status " << o.status << ": " << o.message);
  BOOST_TEST(o.seconds <= timeoutSeconds + kSlackSeconds,
             "error after " << o.seconds << " s, timeout " << timeoutSeconds << " s");
}

// The same bound for a time measured elsewhere (a child process, a rank
// thread's own clock).
inline void expectWithin(double seconds, double timeoutSeconds, const std::string& what) {
  BOOST_TEST(seconds <= timeoutSeconds + kSlackSeconds,
             what << " after " << seconds << " s, timeout " << timeoutSeconds << " s + "
                  << kSlackSeconds << " s slack");
}

}  // namespace sftest
