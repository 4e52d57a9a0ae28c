#pragma once
// A reusable barrier for a fixed number of threads of one process: wait()
// returns once all of them have called it, then the barrier is ready for the
// next round. Blocks on a condition variable (never spins), so waiting costs
// next to no CPU. For tools and tests that drive ranks as threads
// (sfsync-bench --cpu, wire_transport_tests); C++17 has no std::barrier.

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace sfsync {

class ThreadBarrier {
 public:
  explicit ThreadBarrier(int parties) : parties_(parties) {}

  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int parties_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

}  // namespace sfsync
