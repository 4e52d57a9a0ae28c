#pragma once
// The "redis://host:port[/prefix]" store: a hiredis client whose every
// command is bounded by a deadline (Gloo 0.5's RedisStore has no timeout:
// a silent Redis blocked it forever). Keys are written once (SETNX). A
// refused connection is SF_ERR_BACKEND, a silent server SF_ERR_TIMEOUT,
// both naming host:port. Not thread-safe on its own: one command at a time
// under a lock.

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/rendezvous/deadline.h"

struct redisContext;
struct redisReply;

namespace sfsync {

class RedisStore : public gloo::rendezvous::Store {
 public:
  RedisStore(const std::string& host, int port, std::chrono::milliseconds timeout);
  ~RedisStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // One command, bounded by `deadline`; the caller frees the reply.
  redisReply* command(const std::vector<std::string>& argv, Clock::time_point deadline);
  std::string where() const;

  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  redisContext* ctx_ = nullptr;
  std::string brokenBy_;
};

}  // namespace sfsync
