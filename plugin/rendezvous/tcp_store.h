#pragma once
// The "env://" store: a small TCP key-value server run by rank 0 on
// MASTER_ADDR:MASTER_PORT, and a client for every rank (rank 0 included).
// Used only while ranks meet; it carries a few hundred bytes per rank.
//
// The server is one event-loop thread (poll) whatever the number of
// clients; it admits a client only after an HMAC challenge-response on the
// job token (job_token.h) when there is one, keeps every key written once,
// records which connection claimed which rank, and survives strangers:
// garbage, oversize frames, idle or half-open connections and fd
// exhaustion close that connection (one warning line each), never the
// store. The wire format is store_protocol.h.
//
// The client bounds every wait (connect, hello, each request) by the
// timeout it was given and names what it waited for and on whom.

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/rendezvous/deadline.h"
#include "plugin/rendezvous/store_health.h"
#include "plugin/rendezvous/store_protocol.h"

namespace sfsync {

// What the server accepts. Defaults scale with the world size: Gloo writes
// one key per rank holding world_size - 1 addresses of ~136 bytes.
struct StoreLimits {
  size_t maxKeyBytes = 1024;
  size_t maxValueBytes = 0;
  size_t maxKeys = 0;
  size_t maxTotalBytes = 0;
  size_t maxConnections = 1024;
  std::chrono::milliseconds handshakeTimeout{10000};  // hello to authenticated

  static StoreLimits forWorld(int worldSize);
};

class TcpStoreServer;

class TcpStore : public gloo::rendezvous::Store, public StoreHealth {
 public:
  // Rank 0 (isServer) binds and listens; every rank then connects, retrying
  // until `timeout` while the server is not up yet, authenticates with the
  // job token (jobToken()) and, for rank >= 0, claims its rank: a second
  // claimant fails the job with SF_ERR_MISMATCH on every rank.
  TcpStore(const std::string& host, int port, bool isServer, std::chrono::milliseconds timeout,
           int rank = -1, int worldSize = 64);
  ~TcpStore() override;

  // Keys are written once: setting a key again with another value is
  // SF_ERR_MISMATCH; a value above the server's limit SF_ERR_INVALID_ARGUMENT.
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  // Reads what the server pushed (it announces a poisoned job to every
  // client at once) without waiting.
  void checkHealth() override;

 private:
  struct Reply {
    char type = 0;
    std::vector<std::string> fields;
  };
  void connectUntil(Clock::time_point deadline);
  void handshake(Clock::time_point deadline);
  // One request and its reply, both bounded by `deadline`; 'E' replies
  // become sfsync::Error. `what` names the request in messages.
  Reply request(const std::string& frame, const std::string& what, Clock::time_point deadline);
  [[noreturn]] void broken(int status, const std::string& message);
  void drainPushed();  // mutex_ held: throws the job's poison if the server pushed it
  std::string where() const;  // "host:port (rank 0's store)"

  std::unique_ptr<TcpStoreServer> server_;
  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::string token_;
  size_t maxValueBytes_ = 0;
  std::mutex mutex_;  // one request at a time on the socket
  int fd_ = -1;
  store_protocol::FrameParser parser_{store_protocol::kMaxHandshakeFrame};
  std::string brokenBy_;  // set once the connection is unusable
};

}  // namespace sfsync
