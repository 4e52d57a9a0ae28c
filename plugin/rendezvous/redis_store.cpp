#include "plugin/rendezvous/redis_store.h"

#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include <hiredis/hiredis.h>

#include "plugin/core/error.h"

namespace sfsync {

namespace {

timeval untilDeadline(Clock::time_point deadline) {
  const int ms = std::max(pollMs(deadline), 1);  // 0 would mean "no timeout" to hiredis
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

constexpr std::chrono::milliseconds kLastCommandGrace{250};

}  // namespace

RedisStore::RedisStore(const std::string& host, int port, std::chrono::milliseconds timeout)
    : host_(host), port_(port), timeout_(timeout) {
  const auto deadline = deadlineAfter(timeout);
  ctx_ = redisConnectWithTimeout(host.c_str(), port, untilDeadline(deadline));
  if (!ctx_) fail(SF_ERR_OUT_OF_MEMORY, "rendezvous " + where() + ": cannot allocate a hiredis context");
  if (ctx_->err) {
    const std::string why = ctx_->errstr;
    const bool timedOut = Clock::now() >= deadline || why.find("timed out") != std::string::npos;
    redisFree(ctx_);
    ctx_ = nullptr;
    fail(timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
         "rendezvous " + where() + ": cannot connect" +
             (timedOut ? " within " + std::to_string(timeout.count()) + " ms" : "") + ": " + why +
             " (is redis-server running there?)");
  }
}

RedisStore::~RedisStore() {
  if (ctx_) redisFree(ctx_);
}

std::string RedisStore::where() const { return "redis://" + host_ + ":" + std::to_string(port_); }

redisReply* RedisStore::command(const std::vector<std::string>& argv, Clock::time_point deadline) {
  if (!brokenBy_.empty()) {
    fail(SF_ERR_BACKEND, "rendezvous " + where() + ": the connection is unusable after an earlier error: " + brokenBy_);
  }
  redisSetTimeout(ctx_, untilDeadline(deadline));
  std::vector<const char*> args;
  std::vector<size_t> lens;
  for (const auto& a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* reply = static_cast<redisReply*>(redisCommandArgv(ctx_, int(args.size()), args.data(), lens.data()));
  if (!reply) {
    const std::string why = ctx_->errstr;
    const bool timedOut = (ctx_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)) ||
                          Clock::now() >= deadline;
    brokenBy_ = why;
    fail(timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
         "rendezvous " + where() + ": " + argv[0] + " '" + (argv.size() > 1 ? argv[1] : "") + "' " +
             (timedOut ? "got no answer within " + std::to_string(timeout_.count()) +
                             " ms (a stopped or overloaded server, or not Redis?)"
                       : "failed: " + why));
  }
  if (reply->type == REDIS_REPLY_ERROR) {
    const std::string why(reply->str, reply->len);
    freeReplyObject(reply);
    fail(SF_ERR_BACKEND, "rendezvous " + where() + ": " + argv[0] + " failed: " + why);
  }
  return reply;
}

void RedisStore::set(const std::string& key, const std::vector<char>& data) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto deadline = std::max(deadlineAfter(timeout_), Clock::now() + kLastCommandGrace);
  const std::string value(data.begin(), data.end());
  ReplyPtr r(command({"SETNX", key, value}, deadline));
  if (r->type == REDIS_REPLY_INTEGER && r->integer == 1) return;
  ReplyPtr old(command({"GET", key}, deadline));
  if (old->type == REDIS_REPLY_STRING && std::string(old->str, old->len) == value) return;
  fail(SF_ERR_MISMATCH, "rendezvous " + where() + ": key '" + key +
                            "' is already set and keys are written once (a previous job with the same "
                            "prefix, or two processes with the same RANK?): use a fresh prefix per job");
}

std::vector<char> RedisStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::lock_guard<std::mutex> lock(mutex_);
  ReplyPtr r(command({"GET", key}, std::max(deadlineAfter(timeout_), Clock::now() + kLastCommandGrace)));
  if (r->type != REDIS_REPLY_STRING) {
    fail(SF_ERR_BACKEND, "rendezvous " + where() + ": key '" + key + "' vanished");
  }
  return std::vector<char>(r->str, r->str + r->len);
}

void RedisStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RedisStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = deadlineAfter(timeout);
  for (const auto& key : keys) {
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ReplyPtr r(command({"EXISTS", key}, std::max(deadline, Clock::now() + kLastCommandGrace)));
        if (r->type == REDIS_REPLY_INTEGER && r->integer > 0) break;
      }
      if (Clock::now() >= deadline) {
        fail(SF_ERR_TIMEOUT, "rendezvous " + where() + ": timed out after " + std::to_string(timeout.count()) +
                                 " ms waiting for key '" + key + "' (a rank did not arrive?)");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(32));
    }
  }
}

}  // namespace sfsync
