#include "plugin/rendezvous/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/rendezvous/job_token.h"
#include "plugin/rendezvous/store_protocol.h"

namespace sfsync {

namespace sp = store_protocol;

namespace {

constexpr const char* kClientRole = "sfsync-store client";
constexpr const char* kServerRole = "sfsync-store server";
// A request issued at the very end of a wait still gets this long for its
// answer (part of the documented slack).
constexpr std::chrono::milliseconds kLastRequestGrace{250};

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

std::string peerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

bool isLoopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// "(rank 3 has not written it: did it start?)" for Gloo's "<prefix>/<rank>" keys.
std::string rankHint(const std::string& key) {
  size_t slash = key.rfind('/');
  std::string last = slash == std::string::npos ? key : key.substr(slash + 1);
  if (last.empty() || last.size() > 9 || last.find_first_not_of("0123456789") != std::string::npos) {
    return "";
  }
  return " (rank " + last + " has not written it: did it start, with the same MASTER_ADDR:MASTER_PORT?)";
}

}  // namespace

StoreLimits StoreLimits::forWorld(int worldSize) {
  const size_t w = size_t(std::max(worldSize, 1));
  StoreLimits l;
  l.maxValueBytes = std::min<size_t>((1u << 20) + w * 256, 64u << 20);
  l.maxKeys = 4096 + 16 * w;
  l.maxTotalBytes = std::min<size_t>((16u << 20) + w * w * 256, size_t(1) << 30);
  return l;
}

// ---- Server -------------------------------------------------------------------

// Serves the key-value map from one thread: accept, read, answer, close.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, int port, std::string token, StoreLimits limits)
      : token_(std::move(token)), limits_(limits) {
    AddrInfo ai(host, port, true);
    std::string lastError = "no address";
    for (addrinfo* a = ai.list; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
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
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      ::close(listenFd_);
      fail(SF_ERR_BACKEND, std::string("rendezvous env://: pipe: ") + std::strerror(errno));
    }
    reserveFd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    where_ = host + ":" + std::to_string(port);
    if (token_.empty() && !isLoopback(host)) {
      SF_LOG(kWarn, "store",
             "the env:// store on " << where_
                                    << " is open: no SF_AUTH_TOKEN or SF_AUTH_TOKEN_FILE, so anyone "
                                       "who reaches it can read the ranks' addresses or join the job "
                                       "(sfsync-run sets a token; see docs/launchers.md, \"Only the job gets in\")");
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServer() {
    stopping_ = true;
    char b = 1;
    (void)!::write(wake_[1], &b, 1);
    thread_.join();
    for (auto& c : conns_) ::close(c->fd);
    ::close(listenFd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
    if (reserveFd_ >= 0) ::close(reserveFd_);
  }

 private:
  struct Conn {
    int fd = -1;
    uint64_t id = 0;
    std::string peer;
    sp::FrameParser parser{sp::kMaxHandshakeFrame};
    std::string out;
    size_t outOff = 0;
    bool authenticated = false;
    bool closeAfterFlush = false;
    bool dead = false;
    std::string nonce;
    Clock::time_point accepted;
  };

  static constexpr size_t kOutHighWater = 256u << 10;

  size_t maxFrame() const { return 64 + limits_.maxKeyBytes + limits_.maxValueBytes; }

  void logRejected(const Conn& c, const std::string& why) {
    const uint64_t n = ++rejected_;
    if (n <= 100 || n % 1000 == 0) {
      SF_LOG(kWarn, "store", "env:// store on " << where_ << ": rejected client " << c.peer << ": " << why
                                                << (n == 100 ? " (further rejections: every 1000th)" : "")
                                                << (n > 100 ? " [" + std::to_string(n) + " so far]" : ""));
    }
  }

  // Logs, answers `reply` if any, and closes once it is flushed.
  void reject(Conn& c, const std::string& why, const std::string& reply = "") {
    logRejected(c, why);
    if (reply.empty()) {
      c.dead = true;
    } else {
      c.out += reply;
      c.closeAfterFlush = true;
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    while (!stopping_) {
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listenFd_, short(acceptPausedUntil_ > Clock::now() ? 0 : POLLIN), 0});
      auto next = Clock::now() + std::chrono::seconds(1);
      for (auto& c : conns_) {
        short ev = 0;
        if (c->outOff < c->out.size()) ev |= POLLOUT;
        else if (!c->closeAfterFlush) ev |= POLLIN;
        fds.push_back({c->fd, ev, 0});
        if (!c->authenticated) next = std::min(next, c->accepted + limits_.handshakeTimeout);
      }
      if (acceptPausedUntil_ > Clock::now()) next = std::min(next, acceptPausedUntil_);
      const int n = ::poll(fds.data(), fds.size(), pollMs(next));
      if (n < 0 && errno != EINTR) break;
      if (stopping_) break;
      if (fds[1].revents & POLLIN) acceptAll();
      const size_t known = fds.size() - 2;
      for (size_t i = 0; i < known && i < conns_.size(); ++i) {
        Conn& c = *conns_[i];
        const short re = fds[i + 2].revents;
        if (re & (POLLERR | POLLNVAL)) {
          if (!c.authenticated) logRejected(c, "went away (connection reset) before authenticating");
          c.dead = true;
          continue;
        }
        if (re & POLLOUT) flush(c);
        if (!c.dead && (re & (POLLIN | POLLHUP))) readFrom(c);
      }
      const auto now = Clock::now();
      for (auto& c : conns_) {
        if (!c->dead && !c->authenticated && now - c->accepted >= limits_.handshakeTimeout) {
          reject(*c, "did not authenticate within " + std::to_string(limits_.handshakeTimeout.count()) + " ms");
        }
        if (!c->dead && c->closeAfterFlush && c->outOff == c->out.size()) c->dead = true;
      }
      sweep();
    }
  }

  void sweep() {
    for (auto& c : conns_) {
      if (c->dead) {
        ::close(c->fd);
        c->fd = -1;
      }
    }
    conns_.erase(std::remove_if(conns_.begin(), conns_.end(), [](const std::unique_ptr<Conn>& c) { return c->fd < 0; }),
                 conns_.end());
  }

  void acceptAll() {
    for (;;) {
      int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: spend the reserve on taking the stranger off
          // the queue (else poll reports it forever), then take it back.
          if (reserveFd_ >= 0) {
            ::close(reserveFd_);
            reserveFd_ = -1;
            int victim = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (victim >= 0) {
              Conn tmp;
              tmp.peer = peerName(victim);
              logRejected(tmp, std::string("no file descriptor left to serve it (") + std::strerror(EMFILE) +
                                   "); the store keeps serving its clients");
              ::close(victim);
            }
            reserveFd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          }
          if (reserveFd_ < 0) acceptPausedUntil_ = Clock::now() + std::chrono::milliseconds(50);
          return;
        }
        if (errno == ENOBUFS || errno == ENOMEM) {
          acceptPausedUntil_ = Clock::now() + std::chrono::milliseconds(50);
        }
        return;  // EAGAIN: drained
      }
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->id = ++nextId_;
      c->peer = peerName(fd);
      c->accepted = Clock::now();
      if (conns_.size() >= limits_.maxConnections) {
        logRejected(*c, "too many connections (" + std::to_string(conns_.size()) + ")");
        ::close(fd);
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      c->nonce = randomBytes(sp::kNonceBytes);
      c->out = sp::encode('H', {sp::kVersion, c->nonce, token_.empty() ? "0" : "1",
                                std::to_string(limits_.maxValueBytes)});
      flush(*c);
      conns_.push_back(std::move(c));
    }
  }

  void flush(Conn& c) {
    while (c.outOff < c.out.size()) {
      ssize_t w = ::send(c.fd, c.out.data() + c.outOff, c.out.size() - c.outOff, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (w <= 0) {
        c.dead = true;
        return;
      }
      c.outOff += size_t(w);
    }
    c.out.clear();
    c.outOff = 0;
    if (!c.closeAfterFlush) process(c);  // requests that waited for the answer to drain
  }

  void readFrom(Conn& c) {
    char buf[65536];
    ssize_t r = ::recv(c.fd, buf, sizeof buf, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (r <= 0) {
      if (!c.authenticated) logRejected(c, "closed the connection before authenticating");
      c.dead = true;
      return;
    }
    c.parser.feed(buf, size_t(r));
    process(c);
  }

  // Handles buffered frames while the answers fit under the high-water mark.
  void process(Conn& c) {
    while (!c.dead && !c.closeAfterFlush && c.out.size() < kOutHighWater) {
      sp::Message m;
      const auto res = c.parser.next(m);
      if (res == sp::FrameParser::Result::kNeedMore) break;
      if (res == sp::FrameParser::Result::kError) {
        reject(c, "not the sfsync store protocol: " + c.parser.error());
        break;
      }
      sp::Request req;
      std::string error;
      if (!sp::decodeRequest(m, limits_.maxKeyBytes, req, &error)) {
        reject(c, "malformed request: " + error);
        break;
      }
      handle(c, req);
    }
    if (!c.dead) trySend(c);
  }

  // Sends what the socket takes now; the loop waits for POLLOUT for the rest.
  void trySend(Conn& c) {
    if (c.outOff >= c.out.size()) return;
    ssize_t w = ::send(c.fd, c.out.data() + c.outOff, c.out.size() - c.outOff, MSG_NOSIGNAL);
    if (w > 0) c.outOff += size_t(w);
    if (c.outOff == c.out.size()) {
      c.out.clear();
      c.outOff = 0;
    }
  }

  void handle(Conn& c, const sp::Request& req) {
    if (!c.authenticated) {
      if (req.op != 'A') {
        reject(c, std::string("sent request '") + req.op + "' before authenticating",
               sp::encode('E', {"A", "authenticate first"}));
        return;
      }
      if (!token_.empty() && (req.mac.empty() || !sameSecret(req.mac, proof(token_, kClientRole, c.nonce, req.nonce)))) {
        reject(c, req.mac.empty() ? "no job token (SF_AUTH_TOKEN) offered" : "authentication failed: wrong job token",
               sp::encode('E', {"A", "authentication failed"}));
        return;
      }
      c.authenticated = true;
      c.parser.setMaxFrame(maxFrame());
      c.out += sp::encode('K', {token_.empty() ? "" : proof(token_, kServerRole, req.nonce, c.nonce)});
      return;
    }
    if (req.op == 'A') {
      reject(c, "authenticated twice", sp::encode('E', {"P", "already authenticated"}));
      return;
    }
    if (!poison_.empty()) {
      c.out += sp::encode('E', {"J", poison_});
      return;
    }
    switch (req.op) {
      case 'C': {
        auto it = claims_.find(req.rank);
        if (it == claims_.end()) {
          claims_[req.rank] = {c.id, c.peer};
        } else if (it->second.first != c.id) {
          poison_ = "rank " + std::to_string(req.rank) + " was claimed by two processes (from " +
                    it->second.second + " and from " + c.peer +
                    "): every rank of this job stops; start each rank once, with its own RANK";
          SF_LOG(kWarn, "store", "env:// store on " << where_ << ": " << poison_);
          // Tell every client now: ranks already past the store (connecting
          // their pairs) poll for this and stop too.
          for (auto& other : conns_) {
            if (other->authenticated && !other->dead && other.get() != &c) {
              other->out += sp::encode('E', {"J", poison_});
              trySend(*other);
            }
          }
          c.out += sp::encode('E', {"J", poison_});
          return;
        }
        c.out += sp::encode('K', {});
        return;
      }
      case 'S': {
        auto it = data_.find(req.key);
        if (it != data_.end()) {
          if (it->second == req.value) {
            c.out += sp::encode('K', {});
          } else {
            logRejected(c, "tried to overwrite key '" + req.key + "'");
            c.out += sp::encode('E', {"M", "key '" + req.key +
                                               "' is already set and keys are written once (another "
                                               "process with the same RANK, or a second job on the same "
                                               "MASTER_ADDR:MASTER_PORT?)"});
          }
          return;
        }
        if (data_.size() >= limits_.maxKeys ||
            totalBytes_ + req.key.size() + req.value.size() > limits_.maxTotalBytes) {
          logRejected(c, "store full (" + std::to_string(data_.size()) + " keys, " + std::to_string(totalBytes_) + " bytes)");
          c.out += sp::encode('E', {"L", "the store is full (" + std::to_string(limits_.maxKeys) + " keys, " +
                                             std::to_string(limits_.maxTotalBytes) + " bytes at most)"});
          return;
        }
        totalBytes_ += req.key.size() + req.value.size();
        data_.emplace(req.key, req.value);
        c.out += sp::encode('K', {});
        return;
      }
      case 'G': {
        auto it = data_.find(req.key);
        c.out += it == data_.end() ? sp::encode('N', {}) : sp::encode('K', {it->second});
        return;
      }
    }
  }

  const std::string token_;
  const StoreLimits limits_;
  std::string where_;
  int listenFd_ = -1;
  int wake_[2] = {-1, -1};
  int reserveFd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  // Owned by the loop thread:
  std::vector<std::unique_ptr<Conn>> conns_;
  uint64_t nextId_ = 0;
  uint64_t rejected_ = 0;
  Clock::time_point acceptPausedUntil_{};
  std::map<std::string, std::string> data_;
  size_t totalBytes_ = 0;
  std::map<int, std::pair<uint64_t, std::string>> claims_;  // rank -> (connection, peer)
  std::string poison_;
};

// ---- Client -------------------------------------------------------------------

TcpStore::TcpStore(const std::string& host, int port, bool isServer,
                   std::chrono::milliseconds timeout, int rank, int worldSize)
    : host_(host), port_(port), timeout_(timeout), token_(jobToken()) {
  const auto deadline = deadlineAfter(timeout);
  if (isServer) server_ = std::make_unique<TcpStoreServer>(host, port, token_, StoreLimits::forWorld(worldSize));
  try {
    // A server that closes before its hello (out of descriptors, restarting)
    // is retried like one that is not up yet.
    for (;;) {
      connectUntil(deadline);
      if (handshake(deadline)) break;
      std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(20), deadline - Clock::now()));
    }
    if (rank >= 0) {
      request(sp::encode('C', {std::to_string(rank)}), "its claim of rank " + std::to_string(rank),
              std::max(deadline, Clock::now() + kLastRequestGrace));
    }
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);  // the destructor does not run for a throwing constructor
    fd_ = -1;
    throw;
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::where() const {
  return host_ + ":" + std::to_string(port_) + " (rank 0's env:// store)";
}

void TcpStore::broken(int status, const std::string& message) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  brokenBy_ = message;
  fail(status, message);
}

void TcpStore::connectUntil(Clock::time_point deadline) {
  std::string lastError = "no address";
  for (;;) {
    AddrInfo ai(host_, port_, false);
    for (addrinfo* a = ai.list; a && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) {
        lastError = std::strerror(errno);
        continue;
      }
      int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        rc = ::poll(&p, 1, pollMs(deadline));
        int err = 0;
        socklen_t len = sizeof err;
        if (rc == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
          rc = 0;
        } else {
          lastError = rc == 0 ? "no answer to the connection" : std::strerror(err ? err : errno);
          rc = -1;
        }
      } else if (rc != 0) {
        lastError = std::strerror(errno);
      }
      if (rc == 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fd_ = fd;
      } else {
        ::close(fd);
      }
    }
    if (fd_ >= 0) return;
    if (Clock::now() >= deadline) {
      fail(SF_ERR_TIMEOUT, "rendezvous env://: no store at MASTER_ADDR:MASTER_PORT = " + host_ + ":" +
                               std::to_string(port_) + " after " + std::to_string(timeout_.count()) +
                               " ms (" + lastError + "); is rank 0 running?");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(20), deadline - Clock::now()));
  }
}

namespace {

// Sends all of `data` before `deadline`; false on timeout, throws nothing.
// errno-like outcome in *why.
bool sendUntil(int fd, const std::string& data, Clock::time_point deadline, std::string* why) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t w = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (w > 0) {
      off += size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, pollMs(deadline)) == 0) {
        *why = "timeout";
        return false;
      }
      continue;
    }
    *why = std::string("lost: ") + std::strerror(errno);
    return false;
  }
  return true;
}

// Reads one frame before `deadline`: 'T' timeout, 'X' closed/error, 'P'
// protocol error, 'M' message.
char readUntil(int fd, sp::FrameParser& parser, Clock::time_point deadline, sp::Message& out,
               std::string* why) {
  for (;;) {
    const auto res = parser.next(out);
    if (res == sp::FrameParser::Result::kMessage) return 'M';
    if (res == sp::FrameParser::Result::kError) {
      *why = parser.error();
      return 'P';
    }
    char buf[65536];
    ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r > 0) {
      parser.feed(buf, size_t(r));
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, pollMs(deadline)) == 0) return 'T';
      continue;
    }
    *why = r == 0 ? "closed the connection" : std::string("connection error: ") + std::strerror(errno);
    return 'X';
  }
}

}  // namespace

bool TcpStore::handshake(Clock::time_point deadline) {
  sp::FrameParser parser(sp::kMaxHandshakeFrame);
  sp::Message hello;
  std::string why;
  const std::string t = std::to_string(timeout_.count());
  switch (readUntil(fd_, parser, deadline, hello, &why)) {
    case 'T':
      broken(SF_ERR_TIMEOUT, "rendezvous env://: the store at " + where() +
                                 " accepted the connection but sent no hello within " + t +
                                 " ms (is rank 0 stopped or hung, or is another program listening on "
                                 "MASTER_PORT?)");
    case 'X':
      if (Clock::now() < deadline) {
        ::close(fd_);
        fd_ = -1;
        return false;  // try again
      }
      broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() + " " + why + " before its hello");
    case 'P':
      broken(SF_ERR_BACKEND, "rendezvous env://: " + where() +
                                 " does not speak the sfsync store protocol (another program on "
                                 "MASTER_PORT?): " + why);
  }
  if (hello.type != 'H' || hello.fields.size() != 4 || hello.fields[0] != sp::kVersion ||
      hello.fields[1].size() != sp::kNonceBytes) {
    broken(SF_ERR_BACKEND, "rendezvous env://: " + where() +
                               " does not speak version " + sp::kVersion + " of the sfsync store protocol");
  }
  const bool authRequired = hello.fields[2] == "1";
  maxValueBytes_ = std::strtoull(hello.fields[3].c_str(), nullptr, 10);
  if (authRequired && token_.empty()) {
    broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() +
                               " requires the job token: set SF_AUTH_TOKEN or SF_AUTH_TOKEN_FILE as "
                               "for rank 0 (sfsync-run sets it for the ranks it starts)");
  }
  if (!authRequired && !token_.empty()) {
    broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() +
                               " does not check the job token although SF_AUTH_TOKEN is set here "
                               "(rank 0 started without it, or another program serves MASTER_PORT): "
                               "refusing it");
  }
  const std::string nonce = randomBytes(sp::kNonceBytes);
  const std::string mac = token_.empty() ? "" : proof(token_, kClientRole, hello.fields[1], nonce);
  if (!sendUntil(fd_, sp::encode('A', {nonce, mac}), deadline, &why)) {
    broken(why == "timeout" ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
           "rendezvous env://: authenticating with the store at " + where() + ": " + why);
  }
  sp::Message reply;
  switch (readUntil(fd_, parser, deadline, reply, &why)) {
    case 'T':
      broken(SF_ERR_TIMEOUT, "rendezvous env://: timed out after " + t +
                                 " ms waiting for the store at " + where() + " to authenticate this rank");
    case 'X':
    case 'P':
      broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() + " " + why + " while authenticating");
  }
  if (reply.type == 'E') {
    broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() +
                               " refused this rank: authentication failed (SF_AUTH_TOKEN differs from "
                               "rank 0's)");
  }
  if (reply.type != 'K' || reply.fields.size() != 1 ||
      (!token_.empty() && !sameSecret(reply.fields[0], proof(token_, kServerRole, nonce, hello.fields[1])))) {
    broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() +
                               " failed the authentication check: it does not know the job token");
  }
  parser_ = sp::FrameParser(64 + 1024 + maxValueBytes_);
  return true;
}

void TcpStore::drainPushed() {
  if (!poisonedBy_.empty()) fail(SF_ERR_MISMATCH, "rendezvous env://: " + poisonedBy_);
  if (!brokenBy_.empty()) {
    fail(SF_ERR_BACKEND, "rendezvous env://: the connection to the store at " + where() +
                             " is unusable after an earlier error: " + brokenBy_);
  }
  sp::Message m;
  std::string why;
  // Nothing is due between requests but a pushed error: look without waiting.
  switch (readUntil(fd_, parser_, Clock::now(), m, &why)) {
    case 'T':
      return;
    case 'X':
      broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() + " " + why + " (did rank 0 exit?)");
    case 'P':
      broken(SF_ERR_BACKEND, "rendezvous env://: bad data from the store at " + where() + ": " + why);
  }
  const std::string message = m.fields.size() > 1 ? m.fields[1] : "error";
  if (m.type == 'E' && !m.fields.empty() && m.fields[0] == "J") {
    poisonedBy_ = message;
    fail(SF_ERR_MISMATCH, "rendezvous env://: " + message);
  }
  broken(SF_ERR_BACKEND, "rendezvous env://: unexpected data from the store at " + where() + ": " + message);
}

void TcpStore::checkHealth() {
  std::lock_guard<std::mutex> lock(mutex_);
  drainPushed();
}

TcpStore::Reply TcpStore::request(const std::string& frame, const std::string& what,
                                  Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  drainPushed();
  std::string why;
  if (!sendUntil(fd_, frame, deadline, &why)) {
    broken(why == "timeout" ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
           "rendezvous env://: sending " + what + " to the store at " + where() + ": " +
               (why == "timeout" ? "timed out (is rank 0 stopped?)" : why));
  }
  sp::Message m;
  switch (readUntil(fd_, parser_, deadline, m, &why)) {
    case 'T':
      broken(SF_ERR_TIMEOUT, "rendezvous env://: timed out after " + std::to_string(timeout_.count()) +
                                 " ms waiting for the answer to " + what + " from the store at " +
                                 where() + " (is rank 0 stopped or hung?)");
    case 'X':
      broken(SF_ERR_BACKEND, "rendezvous env://: the store at " + where() + " " + why + " (did rank 0 exit?)");
    case 'P':
      broken(SF_ERR_BACKEND, "rendezvous env://: bad answer from the store at " + where() + ": " + why);
  }
  if (m.type == 'E') {
    const std::string code = m.fields.empty() ? "" : m.fields[0];
    const std::string message = m.fields.size() > 1 ? m.fields[1] : "error";
    if (code == "J") poisonedBy_ = message;  // the job is over: say so on every later call
    const int status = code == "M" || code == "J" ? SF_ERR_MISMATCH
                       : code == "L"               ? SF_ERR_INVALID_ARGUMENT
                                                   : SF_ERR_BACKEND;
    fail(status, "rendezvous env://: " + message);
  }
  return {m.type, std::move(m.fields)};
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  if (data.size() > maxValueBytes_) {
    fail(SF_ERR_INVALID_ARGUMENT, "rendezvous env://: value of " + std::to_string(data.size()) +
                                      " bytes for key '" + key + "' exceeds the store's limit of " +
                                      std::to_string(maxValueBytes_) + " bytes");
  }
  if (key.empty() || key.size() > 1024) {
    fail(SF_ERR_INVALID_ARGUMENT, "rendezvous env://: key of " + std::to_string(key.size()) +
                                      " bytes is not in [1, 1024]");
  }
  request(sp::encode('S', {key, std::string(data.begin(), data.end())}), "set '" + key + "'",
          std::max(deadlineAfter(timeout_), Clock::now() + kLastRequestGrace));
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  Reply r = request(sp::encode('G', {key}), "get '" + key + "'",
                    std::max(deadlineAfter(timeout_), Clock::now() + kLastRequestGrace));
  if (r.type != 'K' || r.fields.size() != 1) {
    fail(SF_ERR_BACKEND, "rendezvous env://: key '" + key + "' vanished from the store at " + where());
  }
  return {r.fields[0].begin(), r.fields[0].end()};
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  const auto deadline = deadlineAfter(timeout);
  for (const auto& key : keys) {
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      Reply r = request(sp::encode('G', {key}), "get '" + key + "'",
                        std::max(deadline, Clock::now() + kLastRequestGrace));
      if (r.type == 'K') break;
      if (Clock::now() >= deadline) {
        fail(SF_ERR_TIMEOUT, "rendezvous env://: timed out after " + std::to_string(timeout.count()) +
                                 " ms waiting for key '" + key + "' in the store at " + where() +
                                 rankHint(key));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(32));
    }
  }
}

}  // namespace sfsync
