#include "plugin/rendezvous/rendezvous.h"

#include <cstring>

#include <gloo/rendezvous/store.h>

#include "plugin/core/error.h"
#include "plugin/rendezvous/host_store.h"
#include "plugin/rendezvous/store_factory.h"

namespace sfsync {

Rendezvous::Rendezvous(const sf_options& opts, Admission admission)
    : opts_(opts), admission_(admission) {}

Rendezvous::~Rendezvous() = default;

void Rendezvous::setHostStore(const sf_store& store, const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (opened_) {
    fail(SF_ERR_INVALID_STATE,
         "the context's rendezvous store is already in use; call sf_set_store before "
         "sf_connect, sf_synchronize, sf_broadcast or sf_check_replicas");
  }
  store_ = std::make_shared<HostStore>(store, prefix, std::chrono::milliseconds(opts_.timeout_ms));
  base_ = store_;
}

std::shared_ptr<gloo::rendezvous::Store> Rendezvous::store() {
  std::lock_guard<std::mutex> lock(mutex_);
  opened_ = true;
  if (joinStatus_ != SF_OK) throw Error(joinStatus_, joinError_);
  if (!store_ && std::strcmp(opts_.rendezvous, "host://") == 0) {
    fail(SF_ERR_INVALID_STATE, "rendezvous = 'host://' says that the host hands sfsync its store, "
                               "but sf_set_store was not called before the first collective");
  }
  if (!store_) base_ = store_ = openStore(opts_);
  if (!admitted_ && !guard_) {
    try {
      const LaunchAttempt attempt = LaunchAttempt::fromEnvironment();
      if (attempt.scoped()) {
        const std::chrono::milliseconds timeout(opts_.timeout_ms);
        const auto run = prefixedStore(attempt.runScope(), store_, timeout);
        guard_ = std::make_unique<AttemptGuard>(attempt, run);
        store_ = prefixedStore(attempt.attemptScope(), store_, timeout);
      }
    } catch (const Error& e) {
      joinStatus_ = e.status();
      joinError_ = e.what();
      throw;
    }
  }
  if (!admitted_ && opts_.world_size > 1 && admission_ == Admission::kCheck) {
    auto* host = dynamic_cast<HostStore*>(base_.get());
    const std::string where = host ? "the host's store (keys '" + host->prefix() + "...')"
                                   : "rendezvous '" + std::string(opts_.rendezvous) + "'";
    membership_ = std::make_unique<Membership>(opts_, where, guard_.get());
    try {
      membership_->join(*store_);
    } catch (const Error& e) {
      joinStatus_ = e.status();
      joinError_ = e.what();
      throw;
    }
  }
  admitted_ = true;
  return store_;
}

std::string Rendezvous::recheck() {
  std::shared_ptr<gloo::rendezvous::Store> store;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!admitted_ || !membership_) return "";
    store = store_;
  }
  return membership_->recheck(*store);
}

}  // namespace sfsync
