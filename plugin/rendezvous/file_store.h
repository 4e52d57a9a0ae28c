#pragma once
// The "file:///dir" store: one file per key in a directory that every rank
// sees (one machine, or a shared filesystem). Keys are written once,
// atomically (write a temporary file, then link(2) it into place), and every
// wait is bounded by its timeout, with messages naming the key and the
// directory. Replaces Gloo's FileStore, whose get() waited a fixed 30 s and
// whose errors were not sfsync statuses.

#include <chrono>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace sfsync {

class FileStore : public gloo::rendezvous::Store {
 public:
  FileStore(const std::string& dir, std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::string pathOf(const std::string& key) const;

  std::string dir_;
  std::chrono::milliseconds timeout_;
};

}  // namespace sfsync
