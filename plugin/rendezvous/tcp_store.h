#pragma once
// The "env://" store: a small TCP key-value server run by rank 0 on
// MASTER_ADDR:MASTER_PORT, and a client for every rank (rank 0 included).
// Used only while ranks meet; it carries a few hundred bytes per rank.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace sfsync {

class TcpStoreServer;

class TcpStore : public gloo::rendezvous::Store {
 public:
  // Rank 0 (isServer) binds and listens; every rank then connects, retrying
  // until `timeout` while the server is not up yet.
  TcpStore(const std::string& host, int port, bool isServer, std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // Sends one request; returns whether the key was set (for 'G', the value
  // goes to *out). Throws SF_ERR_BACKEND if the server is gone.
  bool request(char op, const std::string& key, const std::vector<char>& value,
               std::vector<char>* out);

  std::unique_ptr<TcpStoreServer> server_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;  // one request at a time on the socket
  int fd_ = -1;
};

}  // namespace sfsync
