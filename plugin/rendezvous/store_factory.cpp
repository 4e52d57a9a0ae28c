#include "plugin/rendezvous/store_factory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <gloo/rendezvous/prefix_store.h>

#include "plugin/core/error.h"
#include "plugin/core/env.h"
#include "plugin/launch/meeting_point.h"
#include "plugin/rendezvous/file_store.h"
#include "plugin/rendezvous/memory_store.h"
#include "plugin/rendezvous/redis_store.h"
#include "plugin/rendezvous/tcp_store.h"

namespace sfsync {

namespace {

// PrefixStore over a store it keeps alive; a wait without a timeout uses
// the context's timeout_ms (Gloo's default is a fixed 30 s).
class OwningPrefixStore : public gloo::rendezvous::Store, public StoreHealth {
 public:
  OwningPrefixStore(const std::string& prefix, std::shared_ptr<gloo::rendezvous::Store> inner,
                    std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), prefixed_(prefix, *inner_), timeout_(timeout) {}
  void set(const std::string& k, const std::vector<char>& d) override { prefixed_.set(k, d); }
  std::vector<char> get(const std::string& k) override { return prefixed_.get(k); }
  void wait(const std::vector<std::string>& keys) override { prefixed_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    prefixed_.wait(keys, t);
  }
  void checkHealth() override {
    if (auto* h = dynamic_cast<StoreHealth*>(inner_.get())) h->checkHealth();
  }

 private:
  std::shared_ptr<gloo::rendezvous::Store> inner_;
  gloo::rendezvous::PrefixStore prefixed_;
  std::chrono::milliseconds timeout_;
};

bool startsWith(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

void makeDirectories(const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos == path.size() || path[pos] == '/') {
      std::string part = path.substr(0, pos);
      if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
        fail(SF_ERR_BACKEND, "rendezvous file://" + path + ": cannot create directory '" + part +
                                 "': " + std::strerror(errno));
      }
    }
  }
}

}  // namespace

namespace {

std::shared_ptr<gloo::rendezvous::Store> openInner(const sf_options& o) {
  const std::string url = o.rendezvous;
  const std::chrono::milliseconds timeout(o.timeout_ms);
  std::shared_ptr<gloo::rendezvous::Store> inner;
  if (startsWith(url, "memory://") && url.size() > 9) {
    auto memory = MemoryStore::named(url.substr(9));
    memory->claim(o.rank, url);
    inner = memory;
  } else if (startsWith(url, "file://") && url.size() > 7) {
    const std::string path = url.substr(7);
    makeDirectories(path);
    inner = std::make_shared<FileStore>(path, timeout);
  } else if (isTcpRendezvous(url)) {  // env://, tcp://host:port, mpi://
    const MeetingAddress at = meetingAddress(o);
    inner = std::make_shared<TcpStore>(at.host, at.port, o.rank == 0, timeout, o.rank, o.world_size);
  } else if (startsWith(url, "redis://")) {
    std::string rest = url.substr(8), prefix = "sfsync";
    size_t slash = rest.find('/');
    if (slash != std::string::npos) {
      prefix = rest.substr(slash + 1);
      rest = rest.substr(0, slash);
    }
    size_t colon = rest.rfind(':');
    const std::string host = rest.substr(0, colon);
    const int port = colon == std::string::npos ? 6379 : std::atoi(rest.c_str() + colon + 1);
    if (host.empty() || port <= 0 || port > 65535) {
      fail(SF_ERR_INVALID_ARGUMENT, "rendezvous = '" + url + "' is not redis://host:port[/prefix]");
    }
    auto redis = std::make_shared<RedisStore>(host, port, timeout);
    return std::make_shared<OwningPrefixStore>(prefix, redis, timeout);
  } else {
    fail(SF_ERR_INVALID_ARGUMENT,
         "rendezvous = '" + url +
             "' is not one of env://, tcp://host:port, mpi://, file:///dir, redis://host:port[/prefix], "
             "memory://name");
  }
  return std::make_shared<OwningPrefixStore>("sfsync", inner, timeout);
}

}  // namespace

std::shared_ptr<gloo::rendezvous::Store> prefixedStore(
    const std::string& prefix, std::shared_ptr<gloo::rendezvous::Store> inner,
    std::chrono::milliseconds timeout) {
  return std::make_shared<OwningPrefixStore>(prefix, std::move(inner), timeout);
}

std::shared_ptr<gloo::rendezvous::Store> openStore(const sf_options& o) {
  // One store per rendezvous and rank while anyone holds it: the backends of
  // one context (Gloo for host gradients, NCCL's unique-id exchange for
  // device gradients) meet through the same store, and rank 0 can serve
  // env:// only once on MASTER_ADDR:MASTER_PORT.
  std::string key = std::string(o.rendezvous) + "#" + std::to_string(o.rank);
  if (isTcpRendezvous(o.rendezvous)) {
    const MeetingAddress at = meetingAddress(o);
    key += "@" + at.host + ":" + std::to_string(at.port);
  }
  // One lock per entry, held while the store opens: a client rank may wait
  // there for a server that another thread (rank 0) is about to start, so
  // entries must not block each other.
  struct Entry {
    std::mutex mutex;
    std::weak_ptr<gloo::rendezvous::Store> store;
  };
  static std::mutex mapMutex;
  static std::map<std::string, std::shared_ptr<Entry>> entries;
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mapMutex);
    auto& slot = entries[key];
    if (!slot) slot = std::make_shared<Entry>();
    entry = slot;
  }
  std::lock_guard<std::mutex> lock(entry->mutex);
  std::shared_ptr<gloo::rendezvous::Store> store = entry->store.lock();
  if (!store) {
    store = openInner(o);
    entry->store = store;
  }
  return store;
}

std::string localHostname(const sf_options& o) {
  if (const char* h = envValue("SF_GLOO_HOSTNAME")) return h;
  const std::string url = o.rendezvous;
  if (startsWith(url, "memory://")) return "127.0.0.1";
  // mpi:// learns rank 0's address only by bootstrapping: not for a name.
  if (isTcpRendezvous(url) && url != "mpi://") {
    std::string m;
    try {
      m = meetingAddress(o).host;
    } catch (const Error&) {
      // A malformed port: reported where the store is opened, not here.
    }
    if (m == "localhost" || startsWith(m, "127.") || m == "::1") return "127.0.0.1";
  }
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0 || !name[0]) return "127.0.0.1";
  return name;
}

}  // namespace sfsync
