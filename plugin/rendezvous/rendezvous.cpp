#include "plugin/rendezvous/rendezvous.h"

#include <cstring>

#include <gloo/rendezvous/store.h>

#include "plugin/core/error.h"
#include "plugin/rendezvous/host_store.h"
#include "plugin/rendezvous/store_factory.h"

namespace sfsync {

namespace {

// Bounds the calls Gloo makes without a timeout (connectFullMesh's get, the
// plain wait) by timeout_ms: a store's own default (30 s for memory://)
// would otherwise decide how long a missing peer is waited for.
class BoundedStore : public gloo::rendezvous::Store {
 public:
  BoundedStore(std::shared_ptr<gloo::rendezvous::Store> inner, std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), timeout_(timeout) {}
  void set(const std::string& k, const std::vector<char>& v) override { inner_->set(k, v); }
  std::vector<char> get(const std::string& k) override {
    inner_->wait({k}, timeout_);
    return inner_->get(k);
  }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    inner_->wait(keys, t);
  }

 private:
  std::shared_ptr<gloo::rendezvous::Store> inner_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

Rendezvous::Rendezvous(const sf_options& opts) : opts_(opts) {}

Rendezvous::~Rendezvous() = default;

void Rendezvous::setHostStore(const sf_store& store, const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (opened_) {
    fail(SF_ERR_INVALID_STATE,
         "the context's rendezvous store is already in use; call sf_set_store before "
         "sf_connect, sf_synchronize, sf_broadcast or sf_check_replicas");
  }
  store_ = std::make_shared<HostStore>(store, prefix, std::chrono::milliseconds(opts_.timeout_ms));
}

std::shared_ptr<gloo::rendezvous::Store> Rendezvous::store() {
  std::lock_guard<std::mutex> lock(mutex_);
  opened_ = true;
  if (joinStatus_ != SF_OK) throw Error(joinStatus_, joinError_);
  if (!store_ && std::strcmp(opts_.rendezvous, "host://") == 0) {
    fail(SF_ERR_INVALID_STATE, "rendezvous = 'host://' says that the host hands sfsync its store, "
                               "but sf_set_store was not called before the first collective");
  }
  if (!store_) {
    store_ = std::make_shared<BoundedStore>(openStore(opts_),
                                            std::chrono::milliseconds(opts_.timeout_ms));
  }
  if (!admitted_ && opts_.world_size > 1) {
    auto* host = dynamic_cast<HostStore*>(store_.get());
    membership_ = std::make_unique<Membership>(
        opts_, host ? "the host's store (keys '" + host->prefix() + "...')"
                    : "rendezvous '" + std::string(opts_.rendezvous) + "'");
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

bool Rendezvous::opened() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return opened_;
}

}  // namespace sfsync
