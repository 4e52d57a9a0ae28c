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
#include <string>
#include <thread>

#include "sfsync.h"

namespace sfsync {

// How a task ended. Exceptions stay on the worker thread: they are turned
// into this value there (an exception_ptr handed between threads is also
// invisible to ThreadSanitizer through the uninstrumented C++ runtime).
struct TaskResult {
  sf_status status = SF_OK;
  std::string message;
  void throwIfFailed() const;  // sfsync::Error(status, message) unless SF_OK
};

class OrderedExecutor {
 public:
  OrderedExecutor() = default;
  ~OrderedExecutor();  // runs what is queued, then joins
  OrderedExecutor(const OrderedExecutor&) = delete;
  OrderedExecutor& operator=(const OrderedExecutor&) = delete;

  // The future tells how the task ended: an sfsync::Error it threw keeps its
  // status, any other exception is SF_ERR_INTERNAL.
  std::future<TaskResult> submit(std::function<void()> task);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<TaskResult()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // started on the first submit
};

}  // namespace sfsync
