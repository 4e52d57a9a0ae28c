#pragma once
// One worker thread that runs submitted tasks in submission order: how
// blocking collectives (Gloo) overlap the host's backward pass while staying
// in the same order on every rank. Its thread has SIGPIPE blocked, so socket
// work done there cannot kill the host when a peer dies. Not responsible for
// what the tasks do.

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace sfsync {

class OrderedExecutor {
 public:
  OrderedExecutor() = default;
  ~OrderedExecutor();  // runs what is queued, then joins
  OrderedExecutor(const OrderedExecutor&) = delete;
  OrderedExecutor& operator=(const OrderedExecutor&) = delete;

  // The future carries the task's exception, if any.
  std::future<void> submit(std::function<void()> task);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // started on the first submit
};

}  // namespace sfsync
