#include "plugin/rendezvous/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "plugin/core/error.h"

namespace sfsync {

// Wire format, both directions: op/status byte, then length-prefixed fields.
// Requests: 'S' key value -> 'k'; 'G' key -> 'k' value | 'n' (not yet set).
namespace {

bool writeAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

bool readAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

bool writeField(int fd, const char* data, uint32_t n) {
  return writeAll(fd, &n, 4) && (n == 0 || writeAll(fd, data, n));
}

bool readField(int fd, std::vector<char>& out) {
  uint32_t n = 0;
  if (!readAll(fd, &n, 4) || n > (64u << 20)) return false;
  out.resize(n);
  return n == 0 || readAll(fd, out.data(), n);
}

struct AddrInfo {
  addrinfo* list = nullptr;
  AddrInfo(const std::string& host, int port, bool passive) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (rc != 0) {
      fail(SF_ERR_BACKEND, "rendezvous env://: cannot resolve MASTER_ADDR '" + host +
                               "': " + ::gai_strerror(rc));
    }
  }
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

}  // namespace

// Serves the key-value map: one thread accepting, one per connected rank.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, int port) {
    AddrInfo ai(host, port, true);
    std::string lastError = "no address";
    for (addrinfo* a = ai.list; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
        listenFd_ = fd;
        break;
      }
      lastError = std::strerror(errno);
      ::close(fd);
    }
    if (listenFd_ < 0) {
      fail(SF_ERR_BACKEND, "rendezvous env://: rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = " +
                               host + ":" + std::to_string(port) + ": " + lastError);
    }
    acceptThread_ = std::thread([this] { acceptLoop(); });
  }

  ~TcpStoreServer() {
    stopping_ = true;
    ::shutdown(listenFd_, SHUT_RDWR);
    ::close(listenFd_);
    acceptThread_.join();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int fd : clients_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : clientThreads_) t.join();
    for (int fd : clients_) ::close(fd);
  }

 private:
  void acceptLoop() {
    while (!stopping_) {
      int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // closed by the destructor
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) {
        ::close(fd);
        return;
      }
      clients_.push_back(fd);
      clientThreads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  void serve(int fd) {
    for (;;) {
      char op = 0;
      std::vector<char> key, value;
      if (!readAll(fd, &op, 1) || !readField(fd, key)) return;
      std::string k(key.begin(), key.end());
      if (op == 'S') {
        if (!readField(fd, value)) return;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          data_[k] = std::move(value);
        }
        char ok = 'k';
        if (!writeAll(fd, &ok, 1)) return;
      } else if (op == 'G') {
        bool found = false;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          auto it = data_.find(k);
          if (it != data_.end()) {
            found = true;
            value = it->second;
          }
        }
        char status = found ? 'k' : 'n';
        if (!writeAll(fd, &status, 1)) return;
        if (found && !writeField(fd, value.data(), uint32_t(value.size()))) return;
      } else {
        return;  // not our protocol: drop the connection
      }
    }
  }

  int listenFd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptThread_;
  std::mutex mutex_;
  std::vector<int> clients_;
  std::vector<std::thread> clientThreads_;
  std::map<std::string, std::vector<char>> data_;
};

TcpStore::TcpStore(const std::string& host, int port, bool isServer,
                   std::chrono::milliseconds timeout)
    : timeout_(timeout) {
  if (isServer) server_ = std::make_unique<TcpStoreServer>(host, port);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string lastError;
  while (fd_ < 0) {
    AddrInfo ai(host, port, false);
    for (addrinfo* a = ai.list; a && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fd_ = fd;
      } else {
        lastError = std::strerror(errno);
        ::close(fd);
      }
    }
    if (fd_ >= 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      fail(SF_ERR_TIMEOUT, "rendezvous env://: no store at MASTER_ADDR:MASTER_PORT = " + host +
                               ":" + std::to_string(port) + " after " +
                               std::to_string(timeout.count()) + " ms (" + lastError +
                               "); is rank 0 running?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

bool TcpStore::request(char op, const std::string& key, const std::vector<char>& value,
                       std::vector<char>* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  bool ok = writeAll(fd_, &op, 1) && writeField(fd_, key.data(), uint32_t(key.size())) &&
            (op != 'S' || writeField(fd_, value.data(), uint32_t(value.size())));
  char status = 0;
  ok = ok && readAll(fd_, &status, 1);
  const bool found = status == 'k';
  if (ok && found && op == 'G') ok = readField(fd_, *out);
  if (!ok) fail(SF_ERR_BACKEND, "rendezvous env://: lost the connection to rank 0's store");
  return found;
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  request('S', key, data, nullptr);
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::vector<char> value;
  request('G', key, {}, &value);
  return value;
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& key : keys) {
    std::vector<char> value;
    while (!request('G', key, {}, &value)) {
      if (std::chrono::steady_clock::now() > deadline) {
        fail(SF_ERR_TIMEOUT, "rendezvous env://: timed out after " +
                                 std::to_string(timeout.count()) + " ms waiting for key '" + key +
                                 "' (a rank did not arrive)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

}  // namespace sfsync
