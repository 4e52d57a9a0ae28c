#include "plugin/backend/gloo_mesh.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/address.h>

#include "plugin/core/error.h"
#include "plugin/rendezvous/deadline.h"
#include "plugin/rendezvous/store_health.h"

namespace sfsync {

namespace {

// A rendezvous context that takes the pairs we connected ourselves.
class MeshContext : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  void adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(device);
    transportContext_ = std::move(pairs);
  }
  std::vector<char> addressFor(std::vector<char>& all, int peer) { return extractAddress(all, peer); }
};

// Watches a connect in progress: at `deadline`, or as soon as the store
// reports the job unsound (StoreHealth, polled every 50 ms), calls onFire
// once (which closes the pairs and so wakes Gloo's wait). Disarmed when
// destroyed.
class Watchdog {
 public:
  Watchdog(Clock::time_point deadline, StoreHealth* health, std::function<void()> onFire)
      : thread_([this, deadline, health, onFire] {
          std::unique_lock<std::mutex> lock(mutex_);
          for (;;) {
            const auto next = std::min(deadline, Clock::now() + std::chrono::milliseconds(50));
            if (cv_.wait_until(lock, next, [&] { return disarmed_; })) return;
            if (Clock::now() < deadline) {
              if (!health) continue;
              lock.unlock();
              try {
                health->checkHealth();
                lock.lock();
                continue;
              } catch (const Error& e) {
                lock.lock();
                status_ = e.status();
                message_ = e.what();
              }
            }
            fired_ = true;
            lock.unlock();
            onFire();
            return;
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      disarmed_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  bool fired() const { return fired_; }
  // After fired(): the store's complaint, if that is why (else SF_OK: the deadline).
  sf_status status() {
    std::lock_guard<std::mutex> lock(mutex_);
    return status_;
  }
  std::string message() {
    std::lock_guard<std::mutex> lock(mutex_);
    return message_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool disarmed_ = false;
  std::atomic<bool> fired_{false};
  sf_status status_ = SF_OK;
  std::string message_;
  std::thread thread_;
};

// Gloo's rule (tcp::Pair::connect): the side whose address sorts lower
// listens, the other connects.
bool listensFor(const std::vector<char>& self, const std::vector<char>& peer) {
  const auto a = gloo::transport::tcp::Address(self).getSockaddr();
  const auto b = gloo::transport::tcp::Address(peer).getSockaddr();
  if (a.ss_family == AF_INET && b.ss_family == AF_INET) {
    auto* x = reinterpret_cast<const sockaddr_in*>(&a);
    auto* y = reinterpret_cast<const sockaddr_in*>(&b);
    int rv = std::memcmp(&x->sin_addr, &y->sin_addr, sizeof x->sin_addr);
    return rv != 0 ? rv < 0 : int(x->sin_port) - int(y->sin_port) < 0;
  }
  if (a.ss_family == AF_INET6 && b.ss_family == AF_INET6) {
    auto* x = reinterpret_cast<const sockaddr_in6*>(&a);
    auto* y = reinterpret_cast<const sockaddr_in6*>(&b);
    int rv = std::memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr);
    return rv != 0 ? rv < 0 : int(x->sin6_port) - int(y->sin6_port) < 0;
  }
  return false;
}

std::string describe(const std::vector<char>& address) {
  try {
    return gloo::transport::tcp::Address(address).str();
  } catch (...) {
    return "(unreadable address)";
  }
}

}  // namespace

std::shared_ptr<gloo::Context> connectGlooMesh(gloo::rendezvous::Store& store,
                                               const std::shared_ptr<gloo::transport::Device>& device,
                                               int rank, int size, std::chrono::milliseconds timeout) {
  const auto deadline = deadlineAfter(timeout);
  const std::string t = std::to_string(timeout.count());
  auto context = std::make_shared<MeshContext>(rank, size);
  context->setTimeout(timeout);
  std::shared_ptr<gloo::transport::Context> pairs;
  std::vector<char> all;
  try {
    pairs = device->createContext(rank, size);
    pairs->setTimeout(timeout);
    for (int i = 0; i < size; ++i) {
      if (i == rank) continue;
      const auto bytes = pairs->createPair(i)->address().bytes();
      all.insert(all.end(), bytes.begin(), bytes.end());
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(SF_ERR_BACKEND, std::string("gloo connect: cannot create this rank's pairs: ") + e.what());
  }
  store.set(std::to_string(rank), all);

  Watchdog watchdog(deadline, dynamic_cast<StoreHealth*>(&store), [&] {
    for (int i = 0; i < size; ++i) {
      if (i != rank) pairs->getPair(i)->close();  // wakes a connect waiting in Gloo
    }
  });
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    const std::string key = std::to_string(i);
    store.wait({key}, std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::max<Clock::duration>(deadline - Clock::now(), Clock::duration::zero())));
    std::vector<char> theirs = store.get(key);
    const std::vector<char> peer = context->addressFor(theirs, i);
    auto& pair = pairs->getPair(i);
    const std::vector<char> self = pair->address().bytes();
    const bool passive = listensFor(self, peer);
    const std::string who = "rank " + std::to_string(i) + " at " + describe(peer);
    std::string error;
    try {
      if (watchdog.fired()) throw std::runtime_error("deadline");
      pair->connect(peer);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (watchdog.fired() && watchdog.status() != SF_OK) {
      fail(watchdog.status(), watchdog.message() + " (while connecting to " + who + ")");
    }
    if (watchdog.fired()) {
      fail(SF_ERR_TIMEOUT, "gloo connect: timed out after " + t + " ms " +
                               (passive ? "waiting for " + who + " to connect to this rank (listening on " +
                                              describe(self) + "; is that rank stopped or unable to reach this host?)"
                                        : "connecting to " + who + " (no answer: is that rank stopped, or the address unreachable from here?)"));
    }
    if (!error.empty()) {
      const bool timedOut = error.find("imeout") != std::string::npos;
      fail(timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
           "gloo connect " + std::string(passive ? "from " : "to ") + who + ": " + error);
    }
  }
  context->adopt(device, pairs);
  return context;
}

}  // namespace sfsync
