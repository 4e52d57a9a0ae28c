#include "plugin/backend/ordered_executor.h"

#include <signal.h>

#include "plugin/core/error.h"

namespace sfsync {

OrderedExecutor::~OrderedExecutor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void TaskResult::throwIfFailed() const {
  if (status != SF_OK) throw Error(status, message);
}

std::future<TaskResult> OrderedExecutor::submit(std::function<void()> task) {
  std::packaged_task<TaskResult()> packaged([task = std::move(task)]() -> TaskResult {
    try {
      task();
      return {};
    } catch (const Error& e) {
      return {e.status(), e.what()};
    } catch (const std::exception& e) {
      return {SF_ERR_INTERNAL, e.what()};
    } catch (...) {
      return {SF_ERR_INTERNAL, "unknown exception on the worker thread"};
    }
  });
  std::future<TaskResult> result = packaged.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(packaged));
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_one();
  return result;
}

void OrderedExecutor::loop() {
  // A write to a peer that died raises SIGPIPE in the writing thread, whose
  // default action kills the whole host. Blocked here (and inherited by any
  // thread a task creates, such as Gloo's event loop), the write fails with
  // EPIPE instead and the task reports an error.
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  for (;;) {
    std::packaged_task<TaskResult()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace sfsync
