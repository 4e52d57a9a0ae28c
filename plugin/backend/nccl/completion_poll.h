#pragma once
// How the NCCL module waits for the GPU without blocking it: poll a
// completion (a CUDA event) and the communicator's health (NCCL's
// asynchronous error) until done, failed or out of time. Separate from CUDA
// so that the decision logic is tested on machines without a GPU. Not
// responsible for aborting anything: the caller acts on the outcome.

#include <chrono>
#include <thread>

namespace sfsync {
namespace nccl {

enum class Poll {
  kPending,  // not done yet
  kDone,     // the completion happened
  kFailed,   // the completion or the health check reported an error
};

enum class Outcome { kDone, kFailed, kTimedOut };

// Calls done() and healthy() until done() says kDone (kDone), either says
// kFailed (kFailed), or `timeout` passed on `Clock` (kTimedOut). The health
// check runs before every completion check, so an asynchronous error is seen
// even while the completion never comes (a peer that died), and once more
// after the completion: an error raised while the work finished (NCCL sets
// it asynchronously, the event may complete anyway) is kFailed, never kDone.
// Spins with yields
// for about 20 us, then sleeps with a growing pause of at most `maxPause`,
// so that waiting costs little CPU and a finished collective is seen within
// about maxPause.
template <typename Clock = std::chrono::steady_clock, typename Done, typename Healthy,
          typename Sleep>
Outcome pollUntil(Done done, Healthy healthy, std::chrono::milliseconds timeout, Sleep sleep,
                  std::chrono::microseconds maxPause = std::chrono::microseconds(200)) {
  const auto deadline = Clock::now() + timeout;
  std::chrono::microseconds pause(1);
  for (int round = 0;; ++round) {
    if (healthy() == Poll::kFailed) return Outcome::kFailed;
    switch (done()) {
      case Poll::kDone: return healthy() == Poll::kFailed ? Outcome::kFailed : Outcome::kDone;
      case Poll::kFailed: return Outcome::kFailed;
      case Poll::kPending: break;
    }
    if (Clock::now() >= deadline) return Outcome::kTimedOut;
    if (round < 64) {
      sleep(std::chrono::microseconds(0));  // yield
    } else {
      sleep(pause);
      if (pause < maxPause) pause *= 2;
      if (pause > maxPause) pause = maxPause;
    }
  }
}

inline void sleepOrYield(std::chrono::microseconds d) {
  if (d.count() == 0) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(d);
  }
}

}  // namespace nccl
}  // namespace sfsync
